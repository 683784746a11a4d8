import os

# Two cores are shared by every process of a test: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.procs import Children


@pytest.fixture
def children():
    """Spawns child processes and kills every one of them at teardown."""
    kids = Children()
    yield kids
    kids.kill_all()
