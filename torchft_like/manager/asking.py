"""Group rank 0's quorum, applied where it arrives when nothing can block.

Rank 0 asks its own ManagerServer, whose asyncio loop asks the lighthouse.
The quorum thread used to make that call and apply the answer: one wake-up
of that thread to ask, another to apply, and a thread woken from idle costs
about 200 us of CPU on a small VM (bench/NOTES.md, "Step overhead, round
three"). Now the training thread hands the call to the loop, and a steady
answer (the quorum in place, nothing to heal or serve) is applied on the loop
when it arrives. Any other answer, or an error, is settled on the quorum
thread as before, where configuring a process group or moving a state may
block.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from datetime import timedelta
from functools import partial
from typing import Any

from lighthouse.core.views import QuorumResult
from lighthouse.rpc.errors import QuorumTimeoutError
from torchft_like.manager.group.client import LocalManagerClient, ManagerClientProtocol

ResultOf = Callable[[], QuorumResult]


def ask_quorum(
    client: ManagerClientProtocol,
    request: Callable[[], Any],
    timeout: timedelta,
    settle: Callable[[float, ResultOf], None],
    quorum_id: Callable[[], int],
    executor: Executor,
) -> Future[None]:
    """The step's quorum, done once `settle(start, result_of)` has taken the
    answer. Group rank 0 (a LocalManagerClient) asks on its server's loop,
    and a `steady` answer for the group's current `quorum_id()` is settled
    there; any other answer, and every other rank's gRPC call, on
    `executor` (the quorum thread)."""
    start = time.monotonic()
    settle_now = partial(settle, start)
    if not isinstance(client, LocalManagerClient):
        return executor.submit(settle_now, lambda: client.quorum(request(), timeout))
    try:
        asked = client.quorum_future(request(), timeout)
    except Exception as e:  # settled as any failed quorum
        return executor.submit(settle_now, partial(_raise, e))

    def is_steady(result: QuorumResult) -> bool:
        return steady(result, quorum_id())

    return settle_where_it_arrives(asked, is_steady, settle_now, executor)


def steady(result: QuorumResult, quorum_id: int) -> bool:
    """Whether applying `result` is quick and cannot block: the same quorum
    (no process group to configure), no heal to receive or serve."""
    return (
        result.quorum_id == quorum_id
        and not result.heal
        and not result.recover_dst_replica_ranks
        and not result.recover_stripe_dst_replica_ranks
    )


def settle_where_it_arrives(
    asked: Future[QuorumResult],
    is_steady: Callable[[QuorumResult], bool],
    settle: Callable[[ResultOf], None],
    executor: Executor,
) -> Future[None]:
    """A future that is done once `settle` has taken `asked`'s outcome: on
    the thread that completes `asked` (the loop) when its result is steady,
    else on `executor`."""
    done: Future[None] = Future()

    def run(result_of: ResultOf) -> None:
        try:
            settle(result_of)
            done.set_result(None)
        except BaseException as e:
            done.set_exception(e)

    def arrived(f: Future[QuorumResult]) -> None:
        result_of = partial(_outcome, f)
        if not f.cancelled() and f.exception() is None and is_steady(f.result()):
            run(result_of)
            return
        try:
            executor.submit(run, result_of)
        except RuntimeError:  # the Manager shut its executor down
            done.set_exception(QuorumTimeoutError("the Manager shut down during the quorum"))

    asked.add_done_callback(arrived)
    return done


def _outcome(asked: Future[QuorumResult]) -> QuorumResult:
    if asked.cancelled():
        raise QuorumTimeoutError("the manager server stopped before the quorum's answer")
    return asked.result()


def _raise(e: Exception) -> QuorumResult:
    raise e
