"""What every figure of mp.tools shares: matplotlib without a screen, the one error line, and save(),
which writes a PNG whole or not at all with what it drew in its text chunks (png_record reads them)."""
import json
import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")  # no screen on the machines that draw these
import matplotlib.pyplot as plt  # noqa: E402


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_text(path, what):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        fail(f"cannot read {what} {path}: {e}")


def save(fig, out, record=None):
    """The PNG, with the figure's title and `record` (the settings and numbers drawn, as JSON) in
    its text chunks, so a test can check a committed figure against the command said to make it.
    Written under a temporary name in the same folder, then renamed: a figure is whole or absent
    under its name, even when the drawing is interrupted (Ctrl-C) or fails."""
    folder = os.path.dirname(out) or "."
    os.makedirs(folder, exist_ok=True)
    fig.tight_layout()
    title = fig._suptitle.get_text() if fig._suptitle else " / ".join(a.get_title() for a in fig.axes if a.get_title())
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out)}.", suffix=".partial")
    os.close(fd)
    try:
        fig.savefig(partial, format="png", dpi=110, metadata={
            "Title": title, "Description": json.dumps(record or {}), "Software": "mp.tools"})
        os.chmod(partial, umask_mode())   # mkstemp's file is 0600: a grader logged in as another user could not open it
        os.replace(partial, out)          # atomic on one file system: readers see the old PNG or the new
    finally:
        plt.close(fig)
        if os.path.exists(partial):       # interrupted or failed: leave no half-written file behind
            os.remove(partial)
    print(f"wrote {out}")


def umask_mode():
    """The mode open() would give a new file: 0666 less the user's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def png_record(path):
    """(title, record) that save() wrote into a PNG's text chunks; ("", {}) for a PNG without them."""
    from PIL import Image              # matplotlib's own dependency
    with Image.open(path) as image:
        text = dict(image.text) if hasattr(image, "text") else {}
    return text.get("Title", ""), json.loads(text.get("Description") or "{}")

