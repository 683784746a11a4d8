"""lighthouse.loop.wait_for_future: a bounded wait that leaves the future alone."""

import asyncio

import pytest

from lighthouse.loop import wait_for_future


def late() -> Exception:
    return TimeoutError("nothing within the bound")


def test_the_outcome_comes_through_and_a_timeout_raises_the_callers_error():
    async def run() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        loop.call_later(0.01, done.set_result, 7)
        assert await wait_for_future(done, 5, late) == 7
        failed = loop.create_future()
        failed.set_exception(ValueError("refused"))
        with pytest.raises(ValueError, match="refused"):
            await wait_for_future(failed, 5, late)
        pending = loop.create_future()
        with pytest.raises(TimeoutError, match="nothing within"):
            await wait_for_future(pending, 0.01, late)
        assert not pending.done()  # still the owner's to answer
        assert not pending._callbacks  # and nothing of ours left on it

    asyncio.run(run())


def test_cancelling_the_waiter_leaves_the_future_pending():
    """As asyncio.shield: a caller that goes away must not cancel a future
    another (the round, the group's other ranks) still waits on."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        shared = loop.create_future()
        waiting = asyncio.ensure_future(wait_for_future(shared, None, late))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not shared.done() and not shared._callbacks
        shared.set_result("answered")  # the others still get it

    asyncio.run(run())
