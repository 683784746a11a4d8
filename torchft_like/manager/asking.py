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

The step's ask travels as one value, `QuorumAsk`, from the Manager
(rank.py) through here to settling, so that no layer passes it on by
position.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from lighthouse.core.views import QuorumResult
from lighthouse.rpc.errors import QuorumTimeoutError
from torchft_like.manager.group.client import LocalManagerClient, ManagerClientProtocol

if TYPE_CHECKING:
    from torchft_like.manager.group.group_request import QuorumRequest
    from torchft_like.manager.step_state import StepState

ResultOf = Callable[[], QuorumResult]
"""The answer to an ask, or its error raised, when called."""


@dataclass(frozen=True, slots=True)
class QuorumAsk:
    """One step's ask for a quorum, and what settling its answer needs."""

    step: int
    """The Manager's step when it asked."""
    step_state: StepState
    """This step's record; settling writes the quorum's outcome into it."""
    request: Callable[[], QuorumRequest]
    """Builds the request where it is sent: on the quorum thread for a gRPC ask."""
    timeout: timedelta
    allow_heal: bool
    """This step may serve or receive a healing state."""
    every_member_counts: bool
    """Every member of the quorum counts in this step's collectives, a
    healing one too (heal_plan.participation): a synchronous quorum that may heal."""
    started: float
    """time.monotonic() when it was asked; the quorum's latency counts from here."""


def ask_quorum(
    ask: QuorumAsk,
    *,
    client: ManagerClientProtocol,
    settle: Callable[[QuorumAsk, ResultOf], None],
    quorum_id: Callable[[], int],
    executor: Executor,
) -> Future[None]:
    """The step's quorum, done once `settle(ask, result_of)` has taken the
    answer. Group rank 0 (a LocalManagerClient) asks on its server's loop,
    and a `steady` answer for the group's current `quorum_id()` is settled
    there; any other answer, and every other rank's gRPC call, on
    `executor` (the quorum thread)."""

    def settle_now(result_of: ResultOf) -> None:
        settle(ask, result_of)

    if not isinstance(client, LocalManagerClient):
        return executor.submit(settle_now, lambda: client.quorum(ask.request(), ask.timeout))
    try:
        asked = client.quorum_future(ask.request(), ask.timeout)
    except Exception as e:  # settled as any failed quorum
        return executor.submit(settle_now, _raising(e))

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
        def result_of() -> QuorumResult:
            return _outcome(f)

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


def _raising(error: Exception) -> ResultOf:
    """A `ResultOf` that raises `error` (bound now: an except block's name is
    gone once the block ends)."""

    def result_of() -> QuorumResult:
        raise error

    return result_of
