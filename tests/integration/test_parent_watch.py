"""A process that asked to exit with its parent does, within a second of the
parent's SIGKILL (torchft_like.manager.parent_watch), with real processes."""

from __future__ import annotations

import os
import signal
import time

import psutil

from tests.procs import PYTHON
from tests.waiting import wait_until

# The parent starts the child and waits; the child watches its parent and says
# when it is ready. Only the library's torch-free module is imported.
CHILD = (
    "import logging, sys, time; logging.basicConfig(level=logging.INFO); "
    "from torchft_like.manager.parent_watch import exit_with_parent; exit_with_parent(); "
    "print('watching', flush=True); time.sleep(60)"
)
PARENT = (
    "import subprocess, sys; "
    f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}]); "
    "print('child', c.pid, flush=True); c.wait()"
)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_child_exits_within_a_second_of_its_parents_sigkill(children, tmp_path):
    log = tmp_path / "tree.log"
    parent = children.spawn([PYTHON, "-c", PARENT], log=log)
    wait_until(
        lambda: "watching" in log.read_text(),
        30,
        lambda: f"the child to start watching; the log:\n{log.read_text()}",
    )
    child = psutil.Process(int(log.read_text().split("child ")[1].split()[0]))
    os.kill(parent.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    parent.wait(timeout=10)
    # Polled, not child.wait(): an orphan stays a zombie until init reaps it,
    # which psutil's wait counts as alive; a zombie runs nothing.
    while running(child):
        if time.monotonic() - killed_at > 5:
            child.kill()
            raise AssertionError("the orphaned child still runs 5 s after its parent died")
        time.sleep(0.01)
    took_s = time.monotonic() - killed_at
    assert took_s < 1.0, f"the orphan took {took_s:.2f} s to exit"
    assert "parent process" in log.read_text() and "is gone" in log.read_text()


def test_the_watch_does_not_wake_while_the_parent_lives():
    """It waits on a pidfd of the parent, not on a timer: no context switch at all."""
    import threading

    from torchft_like.manager.parent_watch import exit_with_parent

    orphaned = []
    exit_with_parent(on_orphaned=lambda old, new: orphaned.append((old, new)))
    watch = [t for t in threading.enumerate() if t.name == "torchft_parent_watch"][-1]

    def switches() -> int:
        with open(f"/proc/self/task/{watch.native_id}/status") as f:
            line = next(x for x in f if x.startswith("voluntary_ctxt_switches"))
        return int(line.split()[1])

    time.sleep(0.2)  # into its wait
    before = switches()
    time.sleep(1.0)  # ten polls' worth
    assert switches() == before and watch.is_alive() and not orphaned
