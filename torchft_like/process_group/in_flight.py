"""Which collectives of one communicator are overdue: the timeout rule of
ProcessGroupNCCL, pure (no thread, no clock, no CUDA).

Why a rule of its own: an NCCL collective returns to the host at once, and
its failure to finish shows only on the device. Its work answers
`is_completed()` without blocking (a CUDA event query), so one watchdog can
look at the collectives of a communicator in the order they were issued:
one communicator runs them in that order, so the oldest one not completed
is the only one that can be overdue first, and everything before it is
done and can be let go. torchft instead arms a timer per collective that
holds its event (and the work's tensors) until the timeout elapses; here
a finished collective is let go at the next look, at most `RELEASE_S` later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

RELEASE_S = 0.5
"""While collectives are in flight, look at least this often, to let the
finished ones (and the tensors their works hold) go."""


@dataclass(frozen=True)
class Issued:
    name: str
    deadline: float
    is_completed: Callable[[], bool]
    generation: int = 0
    """The owner's communicator it was issued on: an overdue one of a
    communicator already replaced aborts nothing."""


@dataclass(frozen=True)
class Look:
    """What one look at the in-flight collectives found."""

    overdue: Issued | None
    """The oldest collective past its deadline and not completed, if any."""
    next_look: float | None
    """When to look again; None: nothing in flight (or one is overdue)."""


class InFlight:
    """The collectives issued on one communicator and not yet seen completed,
    oldest first. Not thread-safe: its owner holds a lock around it."""

    def __init__(self) -> None:
        self._queue: deque[Issued] = deque()

    def add(self, issued: Issued) -> bool:
        """Appends `issued`; True if it is the only one (a watchdog asleep
        with nothing to watch must be woken to time it)."""
        self._queue.append(issued)
        return len(self._queue) == 1

    def look(self, now: float) -> Look:
        """Lets go of the completed collectives at the front, then judges the oldest left."""
        queue = self._queue
        while queue and queue[0].is_completed():
            queue.popleft()
        if not queue:
            return Look(None, None)
        head = queue[0]
        if now >= head.deadline:
            return Look(head, None)
        return Look(None, min(head.deadline, now + RELEASE_S))

    def clear(self) -> None:
        """Forgets them all (the communicator was aborted or replaced)."""
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)
