import pytest

from tests.procs import Children


@pytest.fixture
def children():
    """Spawns child processes and kills every one of them at teardown."""
    kids = Children()
    yield kids
    kids.kill_all()
