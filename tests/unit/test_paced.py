"""Work paced by its own cost (lighthouse.shell.coordinator.Paced): one run for
every request that comes meanwhile, none sooner than 10x the last run's
cost after it. A real event loop; no sockets."""

from __future__ import annotations

import asyncio
import time

from lighthouse.shell.coordinator import COST_FACTOR, Paced


def test_requests_meanwhile_share_one_run_and_the_next_waits_for_the_pace():
    async def main() -> list[float]:
        runs: list[float] = []
        paced: Paced

        def run() -> None:
            runs.append(time.perf_counter())
            paced.soon()  # asked again while running: the run under way covers it
            paced.ran(0.01)

        paced = Paced(run)
        for _ in range(5):
            paced.soon()
        await asyncio.sleep(0)  # the first: in the next turn
        assert len(runs) == 1 and not paced.due()
        paced.soon()
        paced.soon()
        await asyncio.sleep(COST_FACTOR * 0.01 + 0.05)
        return runs

    runs = asyncio.run(main())
    assert len(runs) == 2
    assert runs[1] - runs[0] >= COST_FACTOR * 0.01 * 0.9


def test_a_run_made_by_the_caller_drops_the_one_asked_for():
    async def main() -> int:
        runs: list[int] = []
        paced = Paced(lambda: runs.append(1))
        paced.soon()
        paced.cancel()  # the caller runs the work itself now
        paced.ran(0.0)
        await asyncio.sleep(0.01)
        return len(runs)

    assert asyncio.run(main()) == 0
