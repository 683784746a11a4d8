"""lighthouse.shell.parked.Deadlines on a real event loop: parked calls' deadlines
share a timer per slot, end at most one slot early and never late, and a
call that ends otherwise is never told it is overdue."""

from __future__ import annotations

import asyncio

from lighthouse.shell.parked import SLOT_S, Deadlines


def test_deadlines_fire_once_within_a_slot_early_never_late_and_not_for_removed_calls():
    async def run() -> tuple[dict[int, float], float, int]:
        loop = asyncio.get_running_loop()
        fired: dict[int, float] = {}
        deadlines = Deadlines(lambda ticket: fired.setdefault(ticket, loop.time()))
        start = loop.time()
        budgets = {1: 0.05, 2: 0.05, 3: 0.12, 4: 0.12}
        slots = {ticket: deadlines.add(ticket, budget) for ticket, budget in budgets.items()}
        timers = len(deadlines._timers)  # noqa: SLF001 (one per slot is what is tested)
        deadlines.remove(slots[4], 4)  # answered before its deadline
        while len(fired) < 3 and loop.time() < start + 10:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # past ticket 4's deadline too
        return {t: at - start - budgets[t] for t, at in fired.items()}, SLOT_S, timers

    early, slot_s, timers = asyncio.run(run())
    assert sorted(early) == [1, 2, 3]
    assert timers == 2  # four calls, two slots
    for ticket, by in early.items():
        assert by >= -slot_s - 0.002, (ticket, by)  # how late depends on the loop


def test_closed_deadlines_never_fire():
    async def run() -> list[int]:
        fired: list[int] = []
        deadlines = Deadlines(fired.append)
        deadlines.add(1, 0.01)
        deadlines.close()
        await asyncio.sleep(0.05)
        return fired

    assert asyncio.run(run()) == []


def test_a_slot_whose_calls_were_all_answered_keeps_no_timer():
    async def run() -> int:
        deadlines = Deadlines(lambda ticket: None)
        slot = deadlines.add(1, 30.0)
        deadlines.remove(slot, 1)
        return len(deadlines._timers) + len(deadlines._slots)  # noqa: SLF001

    assert asyncio.run(run()) == 0
