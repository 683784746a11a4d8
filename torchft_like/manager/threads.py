"""Which thread runs which part of a rank: three roles, named and checked.

- TRAINING: the user's thread (the training loop, and DDP's autograd hooks
  that call allreduce). Every thread the Manager did not start has it.
- QUORUM: the Manager's quorum thread. It settles a quorum answer whose
  application may block: configuring the process group, serving or
  receiving a state, asking the training thread for a state read.
- LOOP: the asyncio loop of group rank 0's ManagerServer. It runs the
  group's gatherings and its lighthouse session, and settles a steady
  quorum answer (nothing to configure, serve or heal) where it arrives.

A call on the wrong thread deadlocks or stalls the group (a state read
asked of the training thread by itself; a blocking transfer on the loop
that must answer the other ranks). `check` turns that into an error that
names both threads. docs/architecture.md has the table of entry points.
"""

from __future__ import annotations

import threading

from lighthouse.loop import set_batch_policy

TRAINING = "training"
QUORUM = "quorum"
LOOP = "loop"

_local = threading.local()


def take(role: str) -> None:
    """Gives the calling thread `role` (the quorum thread's initializer and
    the server's loop do, once)."""
    _local.role = role


def role() -> str:
    """The calling thread's role; TRAINING for any thread the Manager did not start."""
    return getattr(_local, "role", TRAINING)


def check(*roles: str, what: str) -> None:
    """Raises unless the calling thread has one of `roles`.

    Raises:
        RuntimeError: `what` was called on a thread of another role.
    """
    current = role()
    if current not in roles:
        raise RuntimeError(
            f"{what} runs on the {' or '.join(roles)} thread, not on the {current} thread "
            f"({threading.current_thread().name}); see 'Threads' in docs/architecture.md"
        )


def start_quorum_thread(batch: bool) -> None:
    """The quorum thread's initializer: its role, and SCHED_BATCH when
    `batch` (lighthouse.loop.set_batch_policy)."""
    take(QUORUM)
    set_batch_policy(batch)
