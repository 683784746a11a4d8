"""A pytest run ended by SIGTERM tears its fixtures down (tests/conftest.py),
so the children they started are killed rather than left running."""

import signal
import subprocess
import sys

from tests.procs import REPO
from tests.waiting import wait_until

INNER = """
import pathlib, time, pytest

@pytest.fixture
def marked():
    out = pathlib.Path({out!r})
    (out / "started").touch()
    yield
    (out / "torn_down").touch()

def test_waits(marked):
    time.sleep(60)  # until the outer test sends SIGTERM
"""


def test_sigterm_to_pytest_runs_the_fixtures_teardown(tmp_path):
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER.format(out=str(tmp_path)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         str(inner)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def inner_started() -> bool:
        if (tmp_path / "started").exists():
            return True
        assert run.poll() is None, run.communicate()[0].decode()[-2000:]
        return False

    try:
        wait_until(inner_started, 60, "the inner test to start")
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=30)[0].decode()
    finally:
        run.kill()
        run.wait(timeout=10)
    assert (tmp_path / "torn_down").exists(), output[-2000:]
    assert "signal 15" in output
