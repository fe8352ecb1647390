"""Test-only: point torchvision's CIFAR10 at the loopback mirror of tests/cifar_mirror.py, in every
process that has CIFAR10_MIRROR_SPEC set (a JSON file: url, tgz_md5, files: {name: md5})."""
import json
import os

if os.environ.get("CIFAR10_MIRROR_SPEC"):
    from torchvision.datasets import CIFAR10

    with open(os.environ["CIFAR10_MIRROR_SPEC"]) as f:
        spec = json.load(f)
    CIFAR10.url, CIFAR10.tgz_md5 = spec["url"], spec["tgz_md5"]
    CIFAR10.train_list = [[name, spec["files"][name]] for name, _ in CIFAR10.train_list]
    CIFAR10.test_list = [[name, spec["files"][name]] for name, _ in CIFAR10.test_list]
    CIFAR10.meta = dict(CIFAR10.meta, md5=spec["files"][CIFAR10.meta["filename"]])
