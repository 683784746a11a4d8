"""The transport seam's contract (lighthouse.rpc.call): one servicer, one
table, run against both server runtimes (our own and grpcio's, through
lighthouse.rpc.serve) with real grpc clients: the same answers, statuses,
deadlines and cancellations from both, answered in the handler or later."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import grpc
import pytest

from lighthouse.loop import BackgroundLoop
from lighthouse.rpc import auth, errors, serve
from lighthouse.rpc.errors import QuorumTimeoutError
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc

SECRET = "s3cret-for-tests"


class _Servicer(pb_grpc.LighthouseServiceServicer):
    """Each method's behaviour is picked by the request's replica_id."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        """replica_ids whose handler has run its `finally`."""
        self.ended_event = threading.Event()

    def _end(self, what: str) -> None:
        self.ended.append(what)
        self.ended_event.set()

    async def Heartbeat(self, request, call):
        rid = request.replica_id
        if rid == "abort":
            await call.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad: 100% wrong\nsecond line")
        if rid == "boom":
            raise RuntimeError("boom")
        if rid == "slow":
            try:
                await asyncio.sleep(30)
            finally:
                self._end("slow")
        if rid == "wait":  # suspends once, then answers
            await asyncio.sleep(0.01)
        return pb.LighthouseHeartbeatResponse()

    async def Quorum(self, request, call):
        rid = request.requester.replica_id
        if rid.startswith("park"):
            return self._park(rid, call)
        n = request.requester.step
        members = [pb.QuorumMember(replica_id=f"r{i:06d}", address="x" * 90) for i in range(n)]
        remaining = call.time_remaining()
        data = "none" if remaining is None else f"{remaining:.0f}"
        members.append(pb.QuorumMember(replica_id="deadline", data=data))
        return pb.LighthouseQuorumResponse(quorum=pb.Quorum(quorum_id=n, participants=members))

    async def HeartbeatStream(self, request_iterator, call):
        count = 0
        async for _ in request_iterator:
            count += 1
        return pb.LighthouseHeartbeatResponse() if count == 3 else None

    def _park(self, rid, call):
        """Answered later, from outside the handler, as the lighthouse's
        coordinator answers: `park-answer` and `park-fail` after 50 ms,
        `park-now` before the handler returns, `park-never` never."""
        loop = asyncio.get_running_loop()
        answer = pb.LighthouseQuorumResponse(quorum=pb.Quorum(quorum_id=7))
        if rid == "park-now":
            call.answer(answer.SerializeToString())
            return None
        call.park(lambda: self._end(rid))
        if rid == "park-answer":
            loop.call_later(0.05, call.answer, answer.SerializeToString())
        elif rid == "park-fail":
            loop.call_later(0.05, call.fail, QuorumTimeoutError("no quorum: park-fail"))
        return None

    async def HeartbeatPaced(self, request_iterator, call):
        def take(request):
            if request.replica_id == "raise":
                raise ValueError("one replica_id per stream")
            call.write(pb.LighthouseHeartbeatAdvice(interval_ms=len(request.replica_id)))

        try:
            await call.deliver(take)
        except ValueError as e:
            await errors.abort(call, e)
        finally:
            self._end("paced")


@contextlib.contextmanager
def serving(runtime: str, servicer: Any = None):
    """(servicer, port) of a `runtime` server ("lean" or "grpcio") with a
    secret, serving `servicer` (by default the one above)."""
    loop = BackgroundLoop("test-server")
    servicer = servicer or _Servicer()

    async def start():
        srv = serve.new_server(
            pb_grpc.add_LighthouseServiceServicer_to_server, servicer, SECRET, "test", runtime
        )
        port = serve.bind(srv, "127.0.0.1", 0, "pick another port")
        await srv.start()
        return srv, port

    srv, port = loop.run(start())
    try:
        yield servicer, port
    finally:
        loop.run(srv.stop(None), timeout=10)
        loop.stop()


@pytest.fixture(params=["lean", "grpcio"])
def server(request):
    """(servicer, channel factory) of a server of each runtime, with a secret."""
    channels = []
    with serving(request.param) as (servicer, port):

        def channel(secret=SECRET, **kwargs):
            plain = grpc.insecure_channel(f"127.0.0.1:{port}", **kwargs)
            channels.append(plain)
            ch = auth.intercept_channel(plain, secret)
            stub = pb_grpc.LighthouseServiceStub(ch)
            stub.raw = ch.unary_unary  # type: ignore[attr-defined]
            return stub

        yield servicer, channel
        for ch in channels:
            ch.close()


def _status(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_answers_aborts_and_handler_errors_carry_the_same_statuses(server):
    _, channel = server
    stub = channel()
    hb = pb.LighthouseHeartbeatRequest
    assert stub.Heartbeat(hb(replica_id="ok"), timeout=5) == pb.LighthouseHeartbeatResponse()
    assert stub.Heartbeat(hb(replica_id="wait"), timeout=5) == pb.LighthouseHeartbeatResponse()
    assert _status(lambda: stub.Heartbeat(hb(replica_id="abort"), timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "bad: 100% wrong\nsecond line",
    )
    code, details = _status(lambda: stub.Heartbeat(hb(replica_id="boom"), timeout=5))
    assert code == grpc.StatusCode.UNKNOWN and "boom" in details


def test_a_call_without_the_secret_is_refused_saying_what_to_set(server):
    _, channel = server
    for stub in (channel(secret=None), channel(secret="wrong")):
        call = stub.Heartbeat
        code, details = _status(lambda: call(pb.LighthouseHeartbeatRequest(), timeout=5))  # noqa: B023
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "requires the job's shared secret" in details and auth.SECRET_FILE_ENV in details


def test_undecodable_bytes_get_invalid_argument_and_unknown_methods_unimplemented(server):
    _, channel = server
    stub = channel()
    raw = stub.raw("/torchft.LighthouseService/Heartbeat")
    code, details = _status(lambda: raw(b"\xff\xff\xff", timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in details
    missing = stub.raw("/torchft.LighthouseService/Nope")
    assert _status(lambda: missing(b"", timeout=5))[0] == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("compression", [None, grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_a_large_answer_arrives_whole_through_flow_control(server, compression):
    _, channel = server
    stub = channel(compression=compression)
    request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(step=5000))
    quorum = stub.Quorum(request, timeout=20).quorum  # ~500 KB: many frames and window updates
    assert [m.replica_id for m in quorum.participants[:-1]] == [f"r{i:06d}" for i in range(5000)]
    assert quorum.participants[-1].data in ("19", "20")  # the handler saw the deadline
    no_deadline = stub.Quorum(pb.LighthouseQuorumRequest(requester=pb.QuorumMember(step=1)))
    assert no_deadline.quorum.participants[-1].data == "none"


def test_streams_in_and_out(server):
    _, channel = server
    stub = channel()
    three = [pb.LighthouseHeartbeatRequest(replica_id="a")] * 3
    assert stub.HeartbeatStream(iter(three), timeout=5) == pb.LighthouseHeartbeatResponse()
    code, details = _status(lambda: stub.HeartbeatStream(iter(three[:2]), timeout=5))
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)  # no answer returned
    ids = ["a", "bb", "ccc"]
    answers = stub.HeartbeatPaced(iter(pb.LighthouseHeartbeatRequest(replica_id=i) for i in ids))
    assert [a.interval_ms for a in answers] == [1, 2, 3]


def test_a_caller_that_goes_away_cancels_its_handler(server):
    servicer, channel = server
    stub = channel()
    release = threading.Event()

    def forever():
        yield pb.LighthouseHeartbeatRequest(replica_id="a")
        release.wait(10)

    call = stub.HeartbeatPaced(forever())
    assert next(call).interval_ms == 1
    call.cancel()
    assert servicer.ended_event.wait(5) and servicer.ended == ["paced"]
    release.set()


def test_a_passed_deadline_cancels_the_waiting_handler(server):
    servicer, channel = server
    stub = channel()
    start = time.monotonic()
    code, _ = _status(
        lambda: stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="slow"), timeout=0.3)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.ended_event.wait(5) and servicer.ended == ["slow"]
    assert time.monotonic() - start < 3


def test_a_handler_whose_task_is_cancelled_before_it_runs_still_runs_its_finally():
    """The caller went away between the handler's inline first step and its
    task's first turn: the handler must still clean up (a heartbeat stream
    that never ends in the membership, a writer task left pending)."""
    from lighthouse.rpc.lean.server_call import ResumedHandler

    cleaned = []

    async def handler(future):
        try:
            await future
        finally:
            cleaned.append(True)

    async def main():
        future = asyncio.get_running_loop().create_future()
        coro = handler(future)
        first = coro.send(None)  # the inline step: waits on `future`
        task = asyncio.get_running_loop().create_task(ResumedHandler(coro, first))
        task.cancel()  # before the task's first step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]  # now, not when `coro` is garbage one day
        return coro

    asyncio.run(main())


def _quorum(rid):
    return pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=rid))


def test_a_parked_call_is_answered_or_failed_from_outside_its_handler(server):
    servicer, channel = server
    stub = channel()
    assert stub.Quorum(_quorum("park-answer"), timeout=5).quorum.quorum_id == 7
    assert stub.Quorum(_quorum("park-now"), timeout=5).quorum.quorum_id == 7
    code, details = _status(lambda: stub.Quorum(_quorum("park-fail"), timeout=5))
    assert (code, details) == errors.status_text(QuorumTimeoutError("no quorum: park-fail"))
    assert servicer.ended == []  # answered or failed: `on_end` is for the other endings


def test_a_parked_call_whose_caller_goes_away_runs_its_on_end(server):
    servicer, channel = server
    stub = channel()
    code, _ = _status(lambda: stub.Quorum(_quorum("park-never"), timeout=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.ended_event.wait(5) and servicer.ended == ["park-never"]


def test_delivered_requests_and_written_answers_and_a_refusal_mid_stream(server):
    _, channel = server
    stub = channel()
    ids = ["a", "bb", "ccc"]
    answers = stub.HeartbeatPaced(iter(pb.LighthouseHeartbeatRequest(replica_id=i) for i in ids))
    assert [a.interval_ms for a in answers] == [1, 2, 3]
    refused = stub.HeartbeatPaced(
        iter(pb.LighthouseHeartbeatRequest(replica_id=i) for i in ["a", "raise", "bb"])
    )
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for advice in refused:
            got.append(advice.interval_ms)
    assert got == [1]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one replica_id per stream" in e.value.details()
