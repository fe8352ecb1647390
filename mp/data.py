"""The data every program trains on, as a sequence of global batches that every rank can draw
identically: CIFAR-10 through torchvision (downloaded once per machine, under a lock), or a
synthetic, learnable, CIFAR-shaped stand-in made from the seed; the gpt's text (mp/text.py); plus
the slices and the test split."""
import functools
import os
import shutil
import tempfile
import time
import urllib.request

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp.dist import awaiting
from mp.dropout import MASK32, mix
from mp.errors import fail
from mp.fetch import DOWNLOAD_TIMEOUT_S, LOCK_TIMEOUT_S, DataUnavailable, file_lock
from mp.models import NUM_CLASSES
from mp.text import load_text, synthetic_data

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
FAILED_MARK = ".cifar10-download-failed"   # a failed attempt, so the next ranks do not retry it


class SyntheticData:
    """CIFAR-shaped, learnable and deterministic: each class is a smooth random 3x32x32 pattern;
    a sample is its class pattern at a contrast drawn uniformly from [0, CONTRAST] plus noise of
    std 1. The strongest samples are learnt within 50-100 steps (the cnn's loss passes 2.0 near
    step 50 at the defaults); the faintest are noise, so no model gets them all right (the cnn:
    about 88% test accuracy after 300 steps). Batches are generated from (seed, step) on demand,
    so memory stays small however long the run.

    A step's labels and contrasts (one number a sample) come from one generator, so every rank
    draws them all, cheaply. A sample's noise (3,072 numbers) comes from a generator of its own,
    seeded from (seed, step, its index in the batch): a replica or a microbatch draws exactly its
    own samples' images, and every cut of the batch gives the same numbers. The seeds are 32-bit
    hashes (mt19937 takes 32 bits), so in a long run a few samples may share their noise: harmless."""
    name = "synthetic"
    CONTRAST = 0.5   # was 0.03-0.15 until issue 28: the loss sat at 2.30 for ~100 steps
    TEST_STEP = MASK32   # the test set's noise is keyed as this step, which no run reaches

    def __init__(self, seed, test_size=2000, note=None):
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(NUM_CLASSES, 3, 8, 8, generator=g)
        self.prototypes = F.interpolate(coarse, size=32, mode="bilinear", align_corners=False)
        self.seed = seed
        self.note = note       # why --data auto fell back to this set (None when asked for)
        self.test_size = test_size

    @functools.cached_property
    def test_set(self):
        """Made at the first evaluation, not in every rank's start: its 2,000 samples' noise is some 80 ms
        a rank on one core, and a run with --eval-every 0 never reads it (the same numbers either way)."""
        y, contrast = self._classes(self.seed + 7919, self.test_size)
        return self._images(y, contrast, self.TEST_STEP, 0, self.test_size), y

    def _classes(self, key, n):
        """The labels and contrasts of n samples, from the generator seeded with key."""
        g = torch.Generator().manual_seed(key)
        y = torch.randint(NUM_CLASSES, (n,), generator=g)
        return y, self.CONTRAST * torch.rand(n, 1, 1, 1, generator=g)

    def _images(self, y, contrast, step, first, count):
        """Samples first .. first+count-1: each its class pattern at its contrast, plus its own noise."""
        s = slice(first, first + count)
        return contrast[s] * self.prototypes[y[s]] + self._noise(step, first, count)

    def _noise(self, step, first, count):
        """Standard normal noise of samples first .. first+count-1 of a step: sample i's from a
        generator seeded from (seed, step, i), so no sample's noise waits for another's."""
        key = mix(mix(self.seed & MASK32) ^ (step & MASK32))
        out, g = torch.empty(count, 3, 32, 32), torch.Generator()
        for j in range(count):
            out[j].normal_(generator=g.manual_seed(mix(key ^ (first + j))))
        return out

    def _step_classes(self, step, batch_size):
        return self._classes(self.seed * 1_000_003 + step, batch_size)

    def batch(self, step, batch_size):
        y, contrast = self._step_classes(step, batch_size)
        return self._images(y, contrast, step, 0, batch_size), y

    def labels(self, step, batch_size):
        """batch(step, batch_size)[1] without drawing the images."""
        return self._step_classes(step, batch_size)[0]

    def images(self, step, batch_size, first, count):
        """batch(step, batch_size)[0][first:first + count], drawing only those samples' noise."""
        return self._images(*self._step_classes(step, batch_size), step, first, count)

    def image_parts(self, step, batch_size, parts, which=None):
        """batch(step, batch_size)[0] cut into `parts` equal consecutive parts: those numbered in
        `which` (default: all), each drawn only when the one before has been taken (a pipeline's
        first stage streams its microbatches); parts not in `which` are never drawn."""
        y, contrast = self._step_classes(step, batch_size)
        k = batch_size // parts
        return (self._images(y, contrast, step, i * k, k) for i in (range(parts) if which is None else which))


class Cifar10Data:
    """CIFAR-10 held as uint8 tensors, normalised per batch; the order is a seeded permutation
    per epoch, so batch k is the same on every rank and in every program."""
    name = "cifar10"
    note = None
    _permutation = (None, None)   # ((seed, epoch), that epoch's order): the one computed last

    def __init__(self, torchvision, data_dir, seed):
        self.train = self._load(torchvision, data_dir, train=True)
        self.test = self._load(torchvision, data_dir, train=False)
        self.seed = seed

    @staticmethod
    def _load(torchvision, data_dir, train):
        try:  # download=False: the files are there (ensure_cifar10); this checks their md5 sums
            ds = torchvision.datasets.CIFAR10(data_dir, train=train, download=False)
        except Exception as e:  # noqa: BLE001 (a missing or damaged batch file, a bad pickle)
            folder = os.path.join(data_dir, torchvision.datasets.CIFAR10.base_folder)
            fail(f"the CIFAR-10 files in {folder} are damaged ({str(e).splitlines()[0][:100]}); "
                 f"move that folder away to download it afresh, or use --data synthetic", seen_by="every node")
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # uint8 N x 3 x 32 x 32
        return x, torch.tensor(ds.targets)

    @staticmethod
    def normalise(x):
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        return (x.float() / 255 - mean) / std

    def _order(self, step, batch_size):
        """The indices of step's batch: a slice of its epoch's permutation, computed once per epoch
        (a randperm of 50,000 per call would cost more than the batch it orders)."""
        per_epoch = len(self.train[1]) // batch_size
        epoch, i = divmod(step, per_epoch)
        if self._permutation[0] != (self.seed, epoch):     # a step of another epoch replaces it
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = (self.seed, epoch), torch.randperm(len(self.train[1]), generator=g)
        return self._permutation[1][i * batch_size:(i + 1) * batch_size]

    def batch(self, step, batch_size):
        idx = self._order(step, batch_size)
        return self.normalise(self.train[0][idx]), self.train[1][idx]

    def labels(self, step, batch_size):
        """batch(step, batch_size)[1] without normalising the images."""
        return self.train[1][self._order(step, batch_size)]

    def images(self, step, batch_size, first, count):
        """batch(step, batch_size)[0][first:first + count], gathering and normalising only those samples."""
        return self.normalise(self.train[0][self._order(step, batch_size)[first:first + count]])

    def image_parts(self, step, batch_size, parts, which=None):
        """batch(step, batch_size)[0] cut into `parts` equal consecutive parts: those numbered in
        `which` (default: all), each normalised when asked for; parts not in `which` are never read."""
        k = batch_size // parts
        return (self.images(step, batch_size, i * k, k) for i in (range(parts) if which is None else which))

    @functools.cached_property
    def test_set(self):  # normalised once: every evaluation reuses it
        return self.normalise(self.test[0]), self.test[1]


def import_torchvision():
    try:
        import torchvision  # imported here: only the CIFAR-10 path needs it
        return torchvision
    except Exception as e:  # noqa: BLE001 (any import failure means the same thing here)
        raise DataUnavailable(f"torchvision failed to import ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:100]}); install the torchvision that matches "
                              f"torch {torch.__version__}") from None


def download_archive(cifar, archive):
    """Stream the archive into a private temporary file, check its md5, then rename it into place."""
    part = f"{archive}.part{os.getpid()}"
    print(f"downloading CIFAR-10 from {cifar.url} ...", end="", flush=True)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(cifar.url, timeout=DOWNLOAD_TIMEOUT_S) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except (OSError, ValueError) as e:  # URLError, refused, timeout, DNS: no network
        print(" failed", flush=True)
        if os.path.exists(part):
            os.remove(part)             # our own partial file, never the user's
        reason = getattr(e, "reason", e)
        raise DataUnavailable(f"could not download {cifar.url} ({type(e).__name__}: {reason}); for CIFAR-10, "
                              f"run once with network or copy {cifar.filename} into {os.path.dirname(archive)}") from None
    size = os.path.getsize(part)
    from torchvision.datasets.utils import check_integrity
    if not check_integrity(part, cifar.tgz_md5):
        os.remove(part)
        print(" failed", flush=True)
        raise DataUnavailable(f"the download from {cifar.url} ({size} bytes) failed its md5 check; try again later")
    os.replace(part, archive)           # atomic: the archive is whole or absent
    print(f" {size / 1e6:.0f} MB in {time.perf_counter() - start:.0f} s", flush=True)


def extract_archive(torchvision, cifar, archive, data_dir):
    """Unpack into a temporary folder, then rename: a reader sees the whole folder or none."""
    from torchvision.datasets.utils import check_integrity
    if not check_integrity(archive, cifar.tgz_md5):
        fail(f"{archive} is truncated or corrupt (its md5 is not {cifar.tgz_md5}); it was left as it is: "
             f"delete or move it to download afresh, or use --data synthetic", seen_by="every node")
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=data_dir)
    try:
        torchvision.datasets.utils.extract_archive(archive, tmp)
        os.rename(os.path.join(tmp, cifar.base_folder), os.path.join(data_dir, cifar.base_folder))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_cifar10(torchvision, data_dir):
    """Make CIFAR-10 present in data_dir: one process at a time per data dir (every rank and every
    job on this machine) downloads or extracts; the others wait for the lock, then find it done."""
    cifar = torchvision.datasets.CIFAR10
    if os.path.isdir(os.path.join(data_dir, cifar.base_folder)):
        return                                    # already there: read-only data dirs work too
    os.makedirs(data_dir, exist_ok=True)
    with file_lock(os.path.join(data_dir, ".cifar10.lock"), "downloading CIFAR-10", LOCK_TIMEOUT_S):
        if os.path.isdir(os.path.join(data_dir, cifar.base_folder)):
            return                                # another rank or job made it while we waited
        archive, failed = os.path.join(data_dir, cifar.filename), os.path.join(data_dir, FAILED_MARK)
        if not os.path.exists(archive):
            # a rank that just failed to download says why; the next ranks do not wait 30 s each again
            if os.path.exists(failed) and time.time() - os.path.getmtime(failed) < 2 * DOWNLOAD_TIMEOUT_S:
                raise DataUnavailable(open(failed).read())
            try:
                download_archive(cifar, archive)
            except DataUnavailable as e:
                with open(failed, "w") as f:
                    f.write(str(e))
                raise
        extract_archive(torchvision, cifar, archive, data_dir)
        if os.path.exists(failed):
            os.remove(failed)


def load_data(args):
    """The data of --data, before init, so a missing data set fails before any collective.
    --data auto falls back to the synthetic set here; agree_on_data() then makes every rank agree.
    The gpt reads text (mp/text.py)."""
    if args.model == "gpt":
        return load_text(args)
    if args.data == "synthetic":
        return SyntheticData(args.seed)
    try:
        torchvision = import_torchvision()
        try:
            ensure_cifar10(torchvision, args.data_dir)
        except OSError as e:  # a data dir we may not write, a full disk
            raise DataUnavailable(f"cannot write there ({type(e).__name__}: {e}); choose another --data-dir") from None
    except DataUnavailable as e:
        if args.data == "cifar10":
            fail(f"CIFAR-10 is not in --data-dir {args.data_dir}: {e}; or use --data synthetic", seen_by="every node")
        return SyntheticData(args.seed, note=f"CIFAR-10 is not in --data-dir {args.data_dir}: {e}")
    return Cifar10Data(torchvision, args.data_dir, args.seed)


def agree_on_data(data, args, env):
    """After init, under --data auto: if any rank fell back (a node without the files or the
    network), every rank uses the synthetic set. Sets args.data to the data actually used (the
    config record and the plot titles read it); the first rank that fell back prints the one note."""
    lacking = [env.rank] if data.name == "synthetic" else []
    real = "tiny Shakespeare" if args.model == "gpt" else "CIFAR-10"
    if args.data == "auto" and env.world_size > 1:
        mine = torch.tensor([data.name != "synthetic"], dtype=torch.int32, device=env.device)
        every = [torch.zeros_like(mine) for _ in range(env.world_size)]
        with awaiting(f"rank {env.rank} waited for every rank to say which data it found", args.timeout_s):
            dist.all_gather(every, mine)
        lacking = [r for r, t in enumerate(every) if not t.item()]
        if lacking and data.name != "synthetic":
            data = synthetic_data(args) if args.model == "gpt" else SyntheticData(args.seed)
    if args.data == "auto" and lacking and env.rank == lacking[0]:
        ranks = f" (ranks {lacking} of {env.world_size} found no {real})" if len(lacking) < env.world_size else ""
        print(f"note: --data auto uses the SYNTHETIC data{ranks}: {data.note}", flush=True)
    args.data = data.name
    return data


def to_device(tensor, device):
    """A batch onto the rank's device. On a GPU through pinned (page-locked) host memory, which lets
    the copy run asynchronously: the CPU goes on queueing kernels, which the copy precedes on the stream."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def test_batches(data, batch_size):
    """The test split in fixed-size chunks (the last may be smaller)."""
    x, y = data.test_set
    return list(zip(x.split(batch_size), y.split(batch_size)))


def dp_slice(tensor, dp_rank, dp_size):
    """Data-parallel replica dp_rank's contiguous, equal share of a global batch."""
    n = tensor.shape[0] // dp_size
    return tensor[dp_rank * n:(dp_rank + 1) * n]


# ----------------------------------------------------------------------------- a pipeline's inputs


def next_batch(data, step, args, pos, device, replica=(0, 1), stream=False):
    """(inputs, labels) of this step, each only where it is read: the middle stages load nothing,
    and a replica's first stage draws only its own samples (dp_slice's) of the global batch.
    replica: (dp_rank, dp_size). stream: the first stage's inputs as StreamedInputs, drawn one
    microbatch at a time."""
    dp_rank, dp_size = replica
    labels = data.labels(step, args.batch_size) if pos.is_last_stage else None
    y = to_device(dp_slice(labels, dp_rank, dp_size), device) if labels is not None else None
    if pos.is_first_stage and stream:
        return StreamedInputs(data, step, args.batch_size, args.microbatches, replica, device), y
    if pos.is_first_stage:
        n = args.batch_size // dp_size
        return to_device(data.images(step, args.batch_size, dp_rank * n, n), device), y
    return None, y                        # the last stage: the same samples' labels, without their images


class StreamedInputs:
    """The first stage's microbatches of one step, each drawn from the data set when its forward
    reads it (in order), and held from then on only by the runner, until its backward: the first
    stage never holds the global batch's images, so 1F1B's memory is flat in M there too. Replica d
    of D draws parts d*m .. d*m+m-1 of the global batch cut into D*m (dp_slice's samples), and no
    other replica's."""

    def __init__(self, data, step, batch_size, m, replica, device):
        dp_rank, dp_size = replica
        mine = range(dp_rank * m, (dp_rank + 1) * m)
        self.parts = data.image_parts(step, batch_size, m * dp_size, which=mine)
        self.next_mb, self.samples, self.device = 0, batch_size // dp_size, device

    def __len__(self):
        return self.samples

    def __getitem__(self, mb):
        assert mb == self.next_mb, f"microbatch {mb} read out of order (expected {self.next_mb})"
        self.next_mb += 1
        return to_device(next(self.parts), self.device)
