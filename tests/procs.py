"""Child processes for multi-process tests: each in its own session, killed and
checked gone at teardown, so no test can leave a process behind."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.procs import kill_tree, spawn

REPO = Path(__file__).resolve().parent.parent


class Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(
        self, args: list[str], log: Path | None = None, env: dict | None = None
    ) -> subprocess.Popen:
        proc = spawn(args, open(log, "ab") if log else subprocess.PIPE, env, REPO)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILLs every child's whole tree and checks every pid is gone."""
        alive = []
        for proc in self.procs:
            alive += kill_tree(proc.pid)
            proc.wait(timeout=10)
        assert not alive, f"processes still alive after SIGKILL: {[p.pid for p in alive]}"


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    """Reads the child's output until a line matches; fails at the deadline.

    A reader thread per child feeds a queue, so lines already buffered are
    never missed and the wait is bounded whatever the child does."""
    if not hasattr(proc, "lines"):
        proc.lines = queue.Queue()

        def pump() -> None:
            for raw in proc.stdout:
                proc.lines.put(raw.decode(errors="replace"))

        threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(
        f"no line matching {pattern!r} within {timeout} s; output:\n{''.join(seen)}"
    )


PYTHON = sys.executable
