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


NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
"""The reason every `cuda` test is skipped with on a machine without a GPU
(scripts/gpu_check.py reports its checks skipped with the same words)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips the tests marked `cuda` when there is no GPU, saying so."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch  # only when a cuda test was collected

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture
def children():
    """Spawns child processes and kills every one of them at teardown."""
    kids = Children()
    yield kids
    kids.kill_all()
