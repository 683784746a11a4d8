"""The step's quorum ask as one value (manager.asking.QuorumAsk): every
path of `ask_quorum` hands settling the very ask it was given, with the
request built where it is sent. Real threads and futures; no sockets."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import pytest

from lighthouse.core.views import QuorumResult
from lighthouse.rpc.errors import QuorumError
from torchft_like.manager.asking import QuorumAsk, ask_quorum
from torchft_like.manager.group.client import LocalManagerClient
from torchft_like.manager.step_state import StepState

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
TIMEOUT = timedelta(seconds=9)


def make_ask(built: list[str]) -> QuorumAsk:
    def request() -> str:
        built.append(threading.current_thread().name)
        return "request"

    return QuorumAsk(
        step=3,
        step_state=StepState(),
        request=request,
        timeout=TIMEOUT,
        allow_heal=True,
        every_member_counts=False,
        started=1.0,
    )


class GrpcClient:
    """Any client but group rank 0's: asked on the quorum thread."""

    def __init__(self, answer: QuorumResult | Exception) -> None:
        self.answer = answer
        self.asked: list[tuple[str, timedelta]] = []

    def quorum(self, request: str, timeout: timedelta) -> QuorumResult:
        self.asked.append((request, timeout))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class LoopClient(LocalManagerClient):
    """Group rank 0's client without a server: its call is a future, or fails at once."""

    def __init__(self, asked: Future[QuorumResult] | Exception) -> None:
        self.asked = asked
        self.requests: list[tuple[str, timedelta]] = []

    def quorum_future(self, request, timeout):
        self.requests.append((request, timeout))
        if isinstance(self.asked, Exception):
            raise self.asked
        return self.asked


def run(ask: QuorumAsk, client: object, complete=None) -> dict:
    seen: dict = {}

    def settle(got: QuorumAsk, result_of) -> None:
        seen["ask"], seen["thread"] = got, threading.current_thread().name
        try:
            seen["result"] = result_of()
        except Exception as e:
            seen["error"] = e

    with ThreadPoolExecutor(1, thread_name_prefix="quorum") as executor:
        done = ask_quorum(ask, client=client, settle=settle, quorum_id=lambda: 7, executor=executor)
        if complete is not None:
            thread = threading.Thread(target=complete, name="loop")
            thread.start()
            thread.join()
        done.result(timeout=5)
    return seen


@pytest.mark.parametrize("answer", [RESULT, QuorumError("no quorum")], ids=["answer", "error"])
def test_a_grpc_ask_is_built_and_settled_on_the_quorum_thread(answer):
    built: list[str] = []
    ask = make_ask(built)
    client = GrpcClient(answer)
    seen = run(ask, client)
    assert seen["ask"] is ask
    assert built == [seen["thread"]] and seen["thread"].startswith("quorum")
    assert client.asked == [("request", TIMEOUT)]
    assert seen.get("result", seen.get("error")) is answer


def test_group_rank_0s_steady_answer_is_settled_where_it_arrives_with_the_same_ask():
    built: list[str] = []
    ask = make_ask(built)
    asked: Future[QuorumResult] = Future()
    client = LoopClient(asked)
    seen = run(ask, client, complete=lambda: asked.set_result(RESULT))
    assert seen == {"ask": ask, "thread": "loop", "result": RESULT}
    assert built == [threading.main_thread().name]  # asked from the training thread
    assert client.requests == [("request", TIMEOUT)]


def test_group_rank_0s_call_that_fails_at_once_is_settled_with_its_error():
    """The error is bound when raised: an except block's name is gone after it."""
    ask = make_ask([])
    error = QuorumError("server stopped")
    seen = run(ask, LoopClient(error))
    assert seen["ask"] is ask and seen["error"] is error
    assert seen["thread"].startswith("quorum")


def test_an_ask_is_a_frozen_value():
    ask = make_ask([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        ask.allow_heal = False
