"""What a download needs, whichever data it fetches (CIFAR-10 in mp/data.py, tiny Shakespeare in mp/text.py):
a lock that one process at a time holds per data dir, and the exception that means "not here, and not
downloadable": --data auto falls back to the synthetic set on it."""
import fcntl
import time
from contextlib import contextmanager

from mp.errors import fail

DOWNLOAD_TIMEOUT_S = 30   # no answer from the server for this long: treat the machine as offline
LOCK_TIMEOUT_S = 900      # how long a rank waits while another process downloads and extracts


class DataUnavailable(Exception):
    """The data cannot be had here (no torchvision, no network): --data auto falls back to the synthetic set."""


@contextmanager
def file_lock(path, what, timeout_s):
    """An exclusive lock on `path` (released by the kernel if its holder dies), waited for with a timeout."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fail(f"waited {timeout_s:g} s for {path}, held by another process {what}; "
                         f"wait for it to finish, or use another --data-dir", seen_by="every node")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
