import os

# Two cores are shared by every process of a test: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal

import pytest

from tests.procs import Children


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"pytest got signal {signum}")


# A run ended by SIGTERM (`timeout`, a CI runner giving up) tears its fixtures
# down as Ctrl-C does: the children, each in a session of its own, are killed
# instead of training on unseen beside the next run.
signal.signal(signal.SIGTERM, _interrupted)


@pytest.fixture
def children():
    """Spawns child processes and kills every one of them at teardown."""
    kids = Children()
    yield kids
    kids.kill_all()
