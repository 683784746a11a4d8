"""Group rank 0's quorum settled where it arrives: a steady answer on the
thread that completes the call (the server's loop), anything else on the
quorum thread. Real threads and futures; no sockets."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import pytest

from lighthouse.core.views import QuorumResult
from lighthouse.rpc.errors import QuorumError, QuorumTimeoutError
from torchft_like.manager.asking import settle_where_it_arrives, steady

RESULT = QuorumResult(
    quorum_id=7,
    replica_rank=0,
    replica_world_size=2,
    store_address="h:1",
    max_step=3,
    max_replica_rank=0,
    max_world_size=2,
    heal=False,
)


# fmt: off
@pytest.mark.parametrize("result, quorum_id, expected", [
    (RESULT, 7, True),
    (RESULT, 6, False),  # a new quorum: the process group is configured
    (replace(RESULT, heal=True), 7, False),  # we receive a state
    (replace(RESULT, recover_dst_replica_ranks=(1,)), 7, False),  # we serve one
    (replace(RESULT, recover_stripe_dst_replica_ranks=(1,)), 7, False),  # a stripe of it
    (replace(RESULT, divergence="odd one out"), 7, True),  # logged in the server
])
# fmt: on
def test_only_the_quorum_in_place_with_nothing_to_move_is_steady(result, quorum_id, expected):
    assert steady(result, quorum_id) is expected


def settle_in_thread(outcome, is_steady=lambda r: steady(r, 7)):
    """Completes the call from a thread of its own, as the loop would; returns
    the thread that settled, what it settled and the done future."""
    seen: dict = {}

    def settle(result_of):
        seen["thread"] = threading.current_thread().name
        try:
            seen["result"] = result_of()
        except BaseException as e:
            seen["error"] = e

    asked: Future[QuorumResult] = Future()
    with ThreadPoolExecutor(1, thread_name_prefix="quorum") as executor:
        done = settle_where_it_arrives(asked, is_steady, settle, executor)

        def complete():
            if outcome == "cancel":
                asked.cancel()
            elif isinstance(outcome, Exception):
                asked.set_exception(outcome)
            else:
                asked.set_result(outcome)

        loop = threading.Thread(target=complete, name="loop")
        loop.start()
        loop.join()
        done.result(timeout=5)
    return seen


def test_a_steady_answer_is_settled_on_the_thread_it_arrives_on():
    seen = settle_in_thread(RESULT)
    assert seen == {"thread": "loop", "result": RESULT}


@pytest.mark.parametrize(
    "outcome", [replace(RESULT, quorum_id=8), replace(RESULT, heal=True)], ids=["new", "heal"]
)
def test_an_answer_that_may_block_goes_to_the_quorum_thread(outcome):
    seen = settle_in_thread(outcome)
    assert seen["thread"].startswith("quorum") and seen["result"] == outcome


def test_a_failed_call_is_settled_on_the_quorum_thread_with_its_error():
    seen = settle_in_thread(QuorumError("lighthouse says no"))
    assert seen["thread"].startswith("quorum")
    assert str(seen["error"]) == "lighthouse says no"


def test_a_call_cancelled_by_a_stopping_server_is_a_quorum_timeout():
    asked: Future[QuorumResult] = Future()
    seen: dict = {}

    def settle(result_of):
        with pytest.raises(QuorumTimeoutError, match="stopped before the quorum's answer"):
            result_of()
        seen["settled"] = True

    with ThreadPoolExecutor(1) as executor:
        done = settle_where_it_arrives(asked, lambda r: True, settle, executor)
        asked.cancel()
        done.result(timeout=5)
    assert seen == {"settled": True}


def test_an_answer_after_the_manager_shut_down_fails_the_step_instead_of_hanging():
    asked: Future[QuorumResult] = Future()
    executor = ThreadPoolExecutor(1)
    done = settle_where_it_arrives(asked, lambda r: False, lambda result_of: None, executor)
    executor.shutdown()
    asked.set_result(RESULT)
    with pytest.raises(QuorumTimeoutError, match="shut down during the quorum"):
        done.result(timeout=5)
