"""Child process trees for the demo, the tests, the benchmarks and the chaos runner.

Starts children in sessions of their own, finds and signals their whole trees,
kills a tree and waits until it is gone, and reads their JSON-lines logs.
Trees, not process groups: torchrun puts each worker in its own session, so a
signal to torchrun's process group would leave the workers running.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A loopback port free now (a child binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(
    port: int, proc: subprocess.Popen | None, what: str, timeout_s: float = 30
) -> None:
    """Returns once something accepts connections on 127.0.0.1:`port`.

    Raises:
        RuntimeError: `proc` exited first, or nothing listened within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with {proc.returncode} before listening"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} not listening on port {port} after {timeout_s} s"
                ) from None
            time.sleep(0.02)


def spawn(args: list[str], stdout: Any, env: dict[str, str] | None, cwd: Path) -> subprocess.Popen:
    """Starts a child in a session of its own, one thread for math, unbuffered
    output, stderr with stdout: how the demo and the tests run every process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        args, stdout=stdout, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip


def tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its descendants that are alive now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int = signal.SIGKILL) -> list[psutil.Process]:
    """Sends `sig` to `pid` and every descendant at once; returns them."""
    procs = tree(pid)
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return procs


def kill_tree(pid: int, timeout: float = 10) -> list[psutil.Process]:
    """SIGKILLs the tree and waits until every process is gone (a zombie
    counts as gone: it runs nothing); returns those still running."""
    procs = signal_tree(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def wait_all(procs: list[subprocess.Popen], what: str, timeout_s: float) -> None:
    """Waits for every process (each with a `log` path attribute) to exit 0;
    on a failure or the deadline raises with that one's log tail. Every tree
    is killed on the way out, so nothing outlives the caller's run.

    Raises:
        RuntimeError: a process exited non-zero or ran past `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                rc = p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                tail = p.log.read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
                why = f"exited with {rc}" if rc is not None else f"ran past {timeout_s:.0f} s"
                raise RuntimeError(f"{what} failed: a process {why}; its log ends:\n{tail}")
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.wait()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a child's JSON-lines log; a line cut by SIGKILL is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


class PeakRss:
    """The highest RSS of a process, polled in a thread every `interval_s` until `stop`."""

    def __init__(self, process: psutil.Process, interval_s: float = 0.05) -> None:
        self.process = process
        self.peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> int:
        """The peak, in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak
