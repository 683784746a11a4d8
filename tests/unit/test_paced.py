"""Work paced by its own cost (lighthouse.shell.coordinator.Paced): one run for
every request that comes meanwhile, none sooner than 10x the last run's
cost after it. On a virtual clock (tests/unit/virtual_clock.py): no waiting,
exact times."""

from __future__ import annotations

import asyncio

import pytest

from lighthouse.shell.coordinator import COST_FACTOR, Paced
from tests.unit.virtual_clock import VirtualClockLoop


@pytest.fixture
def loop():
    loop = VirtualClockLoop()
    yield loop
    loop.close()


def test_requests_meanwhile_share_one_run_and_the_next_waits_for_the_pace(loop):
    runs: list[float] = []

    async def main() -> None:
        paced: Paced

        def run() -> None:
            runs.append(loop.time())
            paced.soon()  # asked again while running: the run under way covers it
            paced.ran(0.01)

        paced = Paced(run, clock=loop.time)
        for _ in range(5):
            paced.soon()
        await asyncio.sleep(0)  # the first: in the next turn
        assert len(runs) == 1 and not paced.due()
        paced.soon()
        paced.soon()
        await asyncio.sleep(1.0)

    loop.run_until_complete(main())
    assert runs == [0.0, pytest.approx(COST_FACTOR * 0.01)]


def test_a_run_made_by_the_caller_drops_the_one_asked_for(loop):
    runs: list[int] = []

    async def main() -> None:
        paced = Paced(lambda: runs.append(1), clock=loop.time)
        paced.soon()
        paced.cancel()  # the caller runs the work itself now
        paced.ran(0.0)
        await asyncio.sleep(1.0)

    loop.run_until_complete(main())
    assert runs == []
