"""Exit with the parent: a worker whose torchrun dies must not live on as an orphan.

`kill -9` of a group's torchrun leaves its workers running, re-parented to
init (or a subreaper). The other groups then never see a death, and a
restarted torchrun joins as a second live group with the same id and data
shard. A worker that exits as soon as its parent is gone turns killing
torchrun into an ordinary group death: its heartbeat stream closes and the
lighthouse drops the group at once.

Why a thread and not prctl(PR_SET_PDEATHSIG): the death signal fires when
the *thread* that forked the child exits, not the parent process, so a
launcher that starts workers from a short-lived thread kills them spuriously;
it is also Linux-only and lost across an exec of a set-uid binary. The
thread waits on a pidfd of the parent (Linux 5.3+), readable once it has
exited, so it never wakes while the parent lives (a wake-up costs CPU beside
training); elsewhere it compares os.getppid() with the pid seen at start,
every `poll_interval_s`, which works on every POSIX system.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
"""How often the parent pid is checked without a pidfd: an orphan exits
within about this long."""

_started: tuple[int, threading.Thread] | None = None
_lock = threading.Lock()


def exit_with_parent(
    poll_interval_s: float = POLL_INTERVAL_S,
    on_orphaned: Callable[[int, int], None] | None = None,
) -> None:
    """Starts (once per process) a daemon thread that ends the process when
    its parent changes, i.e. the parent died and the process was re-parented.

    Idempotent: several Managers in one process share one watcher.

    Args:
        poll_interval_s: seconds between checks of the parent pid.
        on_orphaned: called with (old parent pid, new parent pid) instead of
            ending the process; for tests only.
    """
    global _started
    if poll_interval_s <= 0:
        raise ValueError(f"poll_interval_s ({poll_interval_s}) must be positive")
    with _lock:
        # A forked child inherits the module state but not the thread: start anew.
        if _started is not None and _started[0] == os.getpid() and on_orphaned is None:
            return
        parent = os.getppid()
        thread = threading.Thread(
            target=_watch,
            args=(parent, poll_interval_s, on_orphaned or _exit_orphaned),
            name="torchft_parent_watch",
            daemon=True,
        )
        thread.start()
        if on_orphaned is None:
            _started = (os.getpid(), thread)
    logger.debug("exiting with parent pid %d (checked every %.2f s)", parent, poll_interval_s)


def _watch(parent: int, poll_interval_s: float, on_orphaned: Callable[[int, int], None]) -> None:
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # not Linux 5.3+, or the parent is gone already
        pidfd = None
    if pidfd is not None:
        try:
            if os.getppid() == parent:  # the pidfd is of our parent, not a reused pid
                select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
    while True:
        now = os.getppid()
        if now != parent:
            on_orphaned(parent, now)
            return
        time.sleep(poll_interval_s)


def _exit_orphaned(parent: int, new_parent: int) -> None:
    logger.error(
        "parent process %d (torchrun or the launcher) is gone (re-parented to %d); "
        "exiting so that this replica group counts as dead and no orphan trains on",
        parent,
        new_parent,
    )
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    # os._exit: a normal exit would join non-daemon threads (gloo, the
    # checkpoint server) that may never end with the group gone.
    os._exit(1)
