"""Child processes for multi-process tests: each in its own session, killed and
checked gone at teardown, so no test can leave a process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Children:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(
        self, args: list[str], log: Path | None = None, env: dict | None = None, **kw
    ) -> subprocess.Popen:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        out = open(log, "ab") if log else subprocess.PIPE
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
            start_new_session=True,
            **kw,
        )
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            kill_tree(proc)
        for proc in self.procs:
            assert_gone(proc)


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signals the whole session of `proc` (torchrun and its workers)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # session id, not a zombie
            pids.append(int(entry))
    return pids


def assert_gone(proc: subprocess.Popen, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = session_pids(proc.pid)
    assert not left, f"processes of session {proc.pid} still alive: {left}"


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    """Reads the child's output until a line matches; fails at the deadline."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(
        f"no line matching {pattern!r} within {timeout} s; output:\n{''.join(seen)}"
    )


PYTHON = sys.executable
