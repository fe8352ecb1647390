import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import launch  # noqa: E402

_baselines = {}


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
                                       "`python -m pytest -q -m 'not slow' tests` leaves these out")
