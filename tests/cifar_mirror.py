"""A fabricated CIFAR-10 in the official format, served from 127.0.0.1, with torchvision's CIFAR10
pointed at it in every process of a test (tests/mirror_site/sitecustomize.py does the pointing).

The archive holds what the real one holds: cifar-10-python.tar.gz with cifar-10-batches-py/
data_batch_1..5, test_batch (pickled dicts: "data" N x 3072 uint8, "labels") and batches.meta,
only with a few hundred random images per batch."""
import hashlib
import http.server
import io
import json
import os
import pickle
import socket
import tarfile
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "mirror_site")        # put on PYTHONPATH: its sitecustomize reads SPEC_ENV
SPEC_ENV = "CIFAR10_MIRROR_SPEC"
FOLDER, ARCHIVE = "cifar-10-batches-py", "cifar-10-python.tar.gz"
NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def md5(data):
    return hashlib.md5(data).hexdigest()


def make_archive(images_per_batch=200, test_images=1000, seed=0):
    """(archive bytes, {file name: md5}) of a small CIFAR-10 in the official layout. The test split
    keeps >= 500 images: the pipeline evaluates in chunks of 500."""
    rng = np.random.default_rng(seed)
    files = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test_images if name == "test_batch" else images_per_batch
        batch = {"batch_label": name, "labels": rng.integers(0, 10, n).tolist(),
                 "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 "filenames": [f"{name}_{i}.png" for i in range(n)]}
        files[name] = pickle.dumps(batch, protocol=2)
    files["batches.meta"] = pickle.dumps({"label_names": NAMES, "num_cases_per_batch": images_per_batch,
                                          "num_vis": 3072}, protocol=2)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{FOLDER}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), {name: md5(data) for name, data in files.items()}


class Mirror:
    """An HTTP server on 127.0.0.1 serving one archive; counts the requests for it."""

    def __init__(self, archive):
        self.archive, self.requests = archive, 0
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                mirror.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(mirror.archive)))
                self.end_headers()
                self.wfile.write(mirror.archive)

            def log_message(self, *args):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/{ARCHIVE}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def closed_port_url():
    """A URL on 127.0.0.1 that nobody listens on: 'offline', deterministically and at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/{ARCHIVE}"


def write_spec(path, url, archive, file_md5s):
    """The spec that sitecustomize.py applies to torchvision.datasets.CIFAR10 in every process."""
    with open(path, "w") as f:
        json.dump({"url": url, "tgz_md5": md5(archive), "files": file_md5s}, f)
    return str(path)


def mirror_env(monkeypatch, spec_path):
    """Make every child process (torchrun and its ranks) see the patched CIFAR10."""
    monkeypatch.setenv(SPEC_ENV, spec_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [SITE, os.environ.get("PYTHONPATH")] if p))
