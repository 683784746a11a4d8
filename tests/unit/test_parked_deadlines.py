"""lighthouse.shell.parked.Deadlines: parked calls' deadlines share a timer
per slot, end at most one slot early and never late, and a call that ends
otherwise is never told it is overdue. On a virtual clock
(tests/unit/virtual_clock.py): no waiting, exact times."""

from __future__ import annotations

import asyncio

import pytest

from lighthouse.shell.parked import SLOT_S, Deadlines
from tests.unit.virtual_clock import VirtualClockLoop


@pytest.fixture
def loop():
    loop = VirtualClockLoop()
    yield loop
    loop.close()


def test_deadlines_fire_once_within_a_slot_early_never_late_and_not_for_removed_calls(loop):
    fired: dict[int, float] = {}
    budgets = {1: 0.05, 2: 0.05, 3: 0.12, 4: 0.12}
    loop.now = 100.0123  # not on a slot boundary

    async def run() -> int:
        deadlines = Deadlines(lambda ticket: fired.setdefault(ticket, loop.time()))
        slots = {ticket: deadlines.add(ticket, budget) for ticket, budget in budgets.items()}
        timers = len(deadlines._timers)  # noqa: SLF001 (one per slot is what is tested)
        deadlines.remove(slots[4], 4)  # answered before its deadline
        await asyncio.sleep(1.0)  # past every deadline
        return timers

    start = loop.now
    timers = loop.run_until_complete(run())
    assert sorted(fired) == [1, 2, 3]
    assert timers == 2  # four calls, two slots
    for ticket, at in fired.items():
        early = start + budgets[ticket] - at
        assert 0 <= early < SLOT_S, (ticket, early)


def test_closed_deadlines_never_fire(loop):
    fired: list[int] = []

    async def run() -> None:
        deadlines = Deadlines(fired.append)
        deadlines.add(1, 0.01)
        deadlines.close()
        await asyncio.sleep(1.0)

    loop.run_until_complete(run())
    assert fired == []


def test_a_slot_whose_calls_were_all_answered_keeps_no_timer(loop):
    async def run() -> int:
        deadlines = Deadlines(lambda ticket: None)
        slot = deadlines.add(1, 30.0)
        deadlines.remove(slot, 1)
        return len(deadlines._timers) + len(deadlines._slots)  # noqa: SLF001

    assert loop.run_until_complete(run()) == 0
