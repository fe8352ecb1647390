import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import USE_ZYGOTE, launch, start_zygote  # noqa: E402

# the launchers' one note when the ranks outnumber the cores (mp.errors.note_shared_cores): every test here runs
# more ranks than the 2 cores, so it is taken as said; the test of the note clears it
os.environ["MP_CORES_NOTED"] = "1"

_baselines = {}


@pytest.fixture(scope="session", autouse=True)
def zygote():
    """The process every launch forks its ranks from (tests/zygote.py), for the whole session."""
    proc = start_zygote() if USE_ZYGOTE else None
    yield proc
    if proc:
        proc.kill()
        proc.wait()
        shutil.rmtree(os.path.dirname(os.environ.pop("TESTS_ZYGOTE")), ignore_errors=True)


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """baseline(args) -> the single_baseline.py Run for those args, computed once per session."""
    def get(args):
        key = tuple(args)
        if key not in _baselines:
            _baselines[key] = launch("single_baseline.py", args, tmp_path_factory.mktemp("baseline"))
        return _baselines[key]
    return get


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a multi-process run of tens of seconds; "
                                       "`python -m pytest -q -n 2 -m 'not slow' tests` leaves these out")
