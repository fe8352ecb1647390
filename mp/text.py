"""The gpt's data: bytes of text (256 symbols, no tokenizer), cut into windows of --seq-len + 1 bytes.

    sample     a window at a seeded offset in the training text: the input is its first S bytes,
               the target of position i the byte after it (i + 1)
    batch      step k's B offsets (and --loss-mask's prefix lengths) come from one generator seeded
               from (seed, k), so every rank draws the same global batch, and every cut of it
    loss mask  --loss-mask prefix:N: each sample's first p targets (p drawn in 0..N) are IGNORE, left
               out of the loss (mp/loss.py), so samples, microbatches and ranks hold different
               counts of valid tokens (as a chat model's prompt tokens are)
    test split the text's last tenth, never trained on, in consecutive windows, every target valid

Three texts: tiny Shakespeare (the char-rnn corpus, 1,115,394 bytes, downloaded once into --data-dir
under a lock and checked by its SHA-256, as CIFAR-10 is), --text-file PATH (any file's bytes), and a
synthetic text made from the seed that a small model can learn (--data synthetic, or --data auto
with neither file nor network)."""
import functools
import hashlib
import os
import random
import time
import urllib.request

import torch

from mp.dropout import MASK32, mix
from mp.errors import fail
from mp.fetch import DOWNLOAD_TIMEOUT_S, LOCK_TIMEOUT_S, DataUnavailable, file_lock

IGNORE = -100                 # a target left out of the loss (F.cross_entropy's ignore_index)
TEST_WINDOWS = 1000           # the test split's windows at most (2 chunks of mp.sizes.EVAL_BATCH)
# tiny Shakespeare: where, its size and its SHA-256 (MP_TEXT_MIRROR="URL SHA256" names a copy elsewhere)
SHAKESPEARE = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
               "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")
SHAKESPEARE_FILE = "tinyshakespeare.txt"
SYNTHETIC_BYTES = 400_000


class TextData:
    """A text as global batches of windows (see the module's docstring). The same calls as the image sets
    (mp/data.py): batch, labels, and a batch's inputs cut in parts (images, image_parts: the names the
    pipelines read), each drawing only what it returns."""

    def __init__(self, raw, name, seed, seq_len, mask_max, note=None):
        cut = len(raw) - len(raw) // 10
        self.train = torch.frombuffer(bytearray(raw[:cut]), dtype=torch.uint8)
        self.held_out = torch.frombuffer(bytearray(raw[cut:]), dtype=torch.uint8)
        self.name, self.seed, self.seq_len, self.mask_max, self.note = name, seed, seq_len, mask_max, note

    def _draw(self, step, batch_size):
        """Step's offsets and prefix lengths, [B] each, from one generator: every rank draws them all."""
        g = torch.Generator().manual_seed(mix(mix(self.seed & MASK32) ^ (step & MASK32)))
        offsets = torch.randint(len(self.train) - self.seq_len, (batch_size,), generator=g)
        return offsets, torch.randint(self.mask_max + 1, (batch_size,), generator=g)

    def _windows(self, step, batch_size, first, count):
        offsets, prefix = self._draw(step, batch_size)
        s = slice(first, first + count)
        return self.train[offsets[s, None] + torch.arange(self.seq_len + 1)].long(), prefix[s]

    def batch(self, step, batch_size):
        """(inputs [B, S], targets [B, S]), int64; masked targets are IGNORE."""
        windows, prefix = self._windows(step, batch_size, 0, batch_size)
        return windows[:, :-1], masked(windows[:, 1:], prefix)

    def labels(self, step, batch_size):
        return self.batch(step, batch_size)[1]

    def images(self, step, batch_size, first, count):
        """batch(step, batch_size)[0][first:first + count]: those samples' inputs only."""
        return self._windows(step, batch_size, first, count)[0][:, :-1]

    def image_parts(self, step, batch_size, parts, which=None):
        k = batch_size // parts
        return (self.images(step, batch_size, i * k, k) for i in (range(parts) if which is None else which))

    @functools.cached_property
    def test_set(self):
        """Consecutive windows of the held-out tenth, every target valid."""
        n = min(TEST_WINDOWS, (len(self.held_out) - 1) // self.seq_len)
        starts = torch.arange(n) * self.seq_len
        windows = self.held_out[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def masked(targets, prefix):
    """targets with each row's first prefix[row] entries set to IGNORE."""
    hide = torch.arange(targets.shape[1]) < prefix[:, None]
    return targets.masked_fill(hide, IGNORE)


def synthetic_text(seed, size=SYNTHETIC_BYTES):
    """A learnable text from the seed: 64 made-up words, each followed by one of its own 3 successors,
    in sentences of 4-12 words. A byte model learns the spelling first (the loss falls from ln 256 = 5.5
    to about 2 within 100 steps of the defaults), then which word follows which."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgk"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(64)]
    follows = [[rng.randrange(64) for _ in range(3)] for _ in range(64)]
    out, length = [], 0
    while length < size:
        w = rng.randrange(64)
        sentence = []
        for _ in range(rng.randint(4, 12)):
            sentence.append(words[w])
            w = rng.choice(follows[w])
        line = " ".join(sentence).capitalize() + (".\n" if rng.random() < 0.3 else ". ")
        out.append(line)
        length += len(line)
    return "".join(out).encode()[:size]


def mirror():
    """(url, sha256) of tiny Shakespeare: the char-rnn repository's, or MP_TEXT_MIRROR's "URL SHA256"."""
    given = os.environ.get("MP_TEXT_MIRROR", "").split()
    return tuple(given) if len(given) == 2 else SHAKESPEARE


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def download_text(url, sha256, path):
    """The file into a private temporary name, its SHA-256 checked, then renamed into place (atomic)."""
    part = f"{path}.part{os.getpid()}"
    print(f"downloading tiny Shakespeare from {url} ...", end="", flush=True)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r, open(part, "wb") as f:
            f.write(r.read())
    except (OSError, ValueError) as e:   # no network, refused, timeout, DNS
        print(" failed", flush=True)
        if os.path.exists(part):
            os.remove(part)              # our own partial file, never the user's
        raise DataUnavailable(f"could not download {url} ({type(e).__name__}: {getattr(e, 'reason', e)}); run "
                              f"once with network, or copy the file to {path}") from None
    if sha256_of(part) != sha256:
        size = os.path.getsize(part)
        os.remove(part)
        print(" failed", flush=True)
        raise DataUnavailable(f"the download from {url} ({size} bytes) is not tiny Shakespeare (its SHA-256 "
                              f"differs); try again later")
    os.replace(part, path)
    print(f" {os.path.getsize(path) / 1e6:.1f} MB in {time.perf_counter() - start:.0f} s", flush=True)


def ensure_shakespeare(data_dir):
    """The path of tiny Shakespeare in data_dir, downloaded by one process at a time per data dir (every rank
    and every job on the machine); a file there that is not it is the user's: an error, left as it is."""
    url, sha256 = mirror()
    path = os.path.join(data_dir, SHAKESPEARE_FILE)
    if not os.path.exists(path):
        try:
            os.makedirs(data_dir, exist_ok=True)
            with file_lock(os.path.join(data_dir, ".text.lock"), "downloading tiny Shakespeare", LOCK_TIMEOUT_S):
                if not os.path.exists(path):     # else another rank or job fetched it while we waited
                    download_text(url, sha256, path)
        except OSError as e:  # a data dir we may not write, a full disk
            raise DataUnavailable(f"cannot write there ({type(e).__name__}: {e}); choose another --data-dir") from None
    if sha256_of(path) != sha256:
        fail(f"{path} is not tiny Shakespeare (its SHA-256 is not {sha256[:12]}...): it was left as it is; move it "
             f"away to download it afresh, or pass it as --text-file", seen_by="every node")
    return path


def load_text(args):
    """The gpt's TextData of --data / --text-file, before init (so a missing file fails before any
    collective); --data auto falls back to the synthetic text with a note (mp.data.agree_on_data)."""
    note, name = None, args.data
    if args.text_file is not None:
        if not os.path.isfile(args.text_file):
            fail(f"--text-file {args.text_file}: no such file; give the path of a text file", seen_by="every node")
        with open(args.text_file, "rb") as f:
            raw, name = f.read(), "text-file"
    elif args.data == "synthetic":
        return synthetic_data(args)
    else:
        try:
            with open(ensure_shakespeare(args.data_dir), "rb") as f:
                raw, name = f.read(), "shakespeare"
        except DataUnavailable as e:
            if args.data == "shakespeare":
                fail(f"tiny Shakespeare is not in --data-dir {args.data_dir}: {e}; or use --data synthetic",
                     seen_by="every node")
            return synthetic_data(args, note=f"tiny Shakespeare is not in --data-dir {args.data_dir}: {e}")
    check_length(raw, args, args.text_file or name)
    return TextData(raw, name, args.seed, args.seq_len, args.mask_max, note)


def synthetic_data(args, note=None):
    """The synthetic text as TextData (note: why --data auto fell back to it)."""
    raw = synthetic_text(args.seed, max(SYNTHETIC_BYTES, 2 * length_needed(args)))
    return TextData(raw, "synthetic", args.seed, args.seq_len, args.mask_max, note)


def length_needed(args):
    """Bytes for one batch of windows in the training nine tenths, and one window in the last tenth."""
    return 10 * args.batch_size * (args.seq_len + 1) // 9 + args.seq_len + 2


def check_length(raw, args, what):
    """One batch of windows in the training nine tenths, and one window held out for the evaluation."""
    need = length_needed(args)
    if len(raw) < need:
        fail(f"{what} holds {len(raw)} bytes, fewer than one batch needs ({need}: --batch-size {args.batch_size} "
             f"windows of --seq-len {args.seq_len} + 1 bytes in the training nine tenths, one held out); give a "
             f"longer text, or a smaller --batch-size or --seq-len", seen_by="every node")
