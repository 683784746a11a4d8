"""Calls parked until their answer (lighthouse.rpc.call's `park`), Quorum
calls and hot spares' TakeReplicaGroup calls alike:
their records and their deadlines. On our own runtime a parked call has no
task and no future; on either, the coordinator answers it through its call
in the turn that issues its quorum, or fails it with its error (its
deadline, a Leave, superseded, shutdown)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from lighthouse import wire
from lighthouse.rpc.call import Call

SLOT_S = 0.025
"""Deadlines that fall within one slot share a timer."""


@dataclasses.dataclass(slots=True)
class Parked:
    """One parked Quorum call."""

    call: Call
    replica_id: str
    ticket: int
    viewer: wire.Viewer | None
    since: float
    """monotonic seconds when it joined (the quorum latency metric)."""
    budget_s: float | None = None
    """How long it may wait (the servicer's reply budget); None: no deadline."""
    slot: int = -1
    """Its deadline's slot in Deadlines (-1: none)."""
    spare: bool = False
    """A TakeReplicaGroup call (`replica_id` is then the spare's id): its
    deadline answers "no group yet" rather than failing it."""


class Deadlines:
    """Parked calls' deadlines, one timer per SLOT_S of them: at a step's
    burst 10,000 calls park, and a timer each would cost a TimerHandle and
    a heap push to set and a cancel to clear. A call is told up to one slot
    early, never late: the servicer's budget keeps the caller's margin."""

    def __init__(self, overdue: Callable[[int], None]) -> None:
        """`overdue(ticket)`: the call's time is up (it may have ended since)."""
        self._overdue = overdue
        self._slots: dict[int, set[int]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def add(self, ticket: int, budget_s: float) -> int:
        """Returns the slot to `remove` the ticket from when its call ends otherwise."""
        loop = asyncio.get_running_loop()
        slot = int((loop.time() + budget_s) / SLOT_S)
        tickets = self._slots.get(slot)
        if tickets is None:
            tickets = self._slots[slot] = set()
            self._timers[slot] = loop.call_at(slot * SLOT_S, self._fire, slot)
        tickets.add(ticket)
        return slot

    def remove(self, slot: int, ticket: int) -> None:
        tickets = self._slots.get(slot)
        if tickets is not None:
            tickets.discard(ticket)
            if not tickets:  # its calls all answered: nothing is kept to their deadline
                del self._slots[slot]
                self._timers.pop(slot).cancel()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._slots.clear()
        self._timers.clear()

    def _fire(self, slot: int) -> None:
        self._timers.pop(slot, None)
        for ticket in self._slots.pop(slot, ()):
            self._overdue(ticket)
