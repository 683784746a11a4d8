"""Malformed and extreme requests against real servers: the lighthouse, a
ManagerServer and the checkpoint HTTP server. Each must answer with a proper
status, never crash, and go on serving the healthy members afterwards.

Raw gRPC requests go through a generic `channel.unary_unary` with identity
serializers, so the bytes reach the server exactly as generated.
"""

from __future__ import annotations

import http.client
import logging
import re
import socket
import struct
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from urllib.parse import urlsplit

import grpc
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lighthouse import (
    LighthouseClient,
    LighthouseServer,
    LighthouseUnavailableError,
    QuorumTimeoutError,
)
from lighthouse.rpc.proto import torchft_pb2 as pb
from tests.waiting import wait_until
from torchft_like.checkpointing import HTTPTransport
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]
T = timedelta(seconds=10)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
WAIT_S = 0.05
"""Deadline of a fuzzed call that must wait (for a quorum or the other rank)."""
ANSWER_S = 5.0
"""Deadline of a call that must be refused: ample on a loaded machine."""
RAW_S = 0.25
"""Deadline of a call of raw bytes, which may or may not be well-formed."""

INT64 = st.one_of(
    st.sampled_from([-(2**63), -1, 0, 1, 2**63 - 1]), st.integers(-(2**63), 2**63 - 1)
)
UINT64 = st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1))
HUGE = [1 << 10, 1 << 20, 5 << 20]
"""String lengths; 5 MiB is over gRPC's default 4 MiB message limit."""
TEXT = st.integers(0, 7).flatmap(
    # One string in eight is huge: each such call waits out a longer deadline.
    lambda k: st.sampled_from(HUGE).map(lambda n: "r" * n) if k == 0 else st.text(max_size=30)
)

# Statuses that mean "your request was handled and refused or timed out";
# UNKNOWN and INTERNAL would mean the server raised.
REFUSED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}


def raw_call(
    channel: grpc.Channel, method: str, payload: bytes, timeout: float = RAW_S
) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    if len(payload) > 1 << 16:
        timeout = max(timeout, 0.5)  # megabytes take a while just to travel
    try:
        call(payload, timeout=timeout)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def check(
    channel: grpc.Channel, method: str, payload: bytes, expected: tuple[grpc.StatusCode, str]
) -> None:
    """Sends `payload`; the answer must have the expected code and a message
    containing the expected word (the field at fault)."""
    want, word = expected
    timeout = WAIT_S if want == grpc.StatusCode.DEADLINE_EXCEEDED else ANSWER_S
    code, details = raw_call(channel, method, payload, timeout)
    assert_refused_properly(code, details)
    assert code == want, details[:300]
    assert word in details, details[:300]


TOO_BIG = (grpc.StatusCode.RESOURCE_EXHAUSTED, "")
WAITS = (grpc.StatusCode.DEADLINE_EXCEEDED, "")


def assert_refused_properly(code: grpc.StatusCode, details: str) -> None:
    assert code in REFUSED, f"{code}: {details[:300]}"
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert details, f"{code} without a message"


@pytest.fixture(autouse=True)
def no_server_errors(caplog):
    """A server that logs an error (a traceback from a handler) has not handled
    the input, whatever status the client saw."""
    yield
    errors = [
        r
        for r in caplog.get_records("call")
        # grpc's note that a caller went away before its answer could be sent.
        if r.levelno >= logging.ERROR and "ExecuteBatchError" not in r.getMessage()
    ]
    assert not errors, "\n".join(r.getMessage()[:300] for r in errors)


@pytest.fixture(scope="module")
def lighthouse():
    # Fuzzed replica ids stay healthy for heartbeat_timeout_ms: keep it short so
    # the healthy members are not outvoted for long afterwards. min_replicas=2:
    # a lone (fuzzed) caller never gets a quorum, so every well-formed fuzzed
    # call must end at its deadline.
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=300
    )
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def lighthouse_channel(lighthouse):
    channel = grpc.insecure_channel(lighthouse.address().removeprefix("http://"))
    yield channel
    channel.close()


def healthy_pair_gets_a_quorum(lighthouse: LighthouseServer) -> None:
    """Two well-behaved replicas still get one quorum of exactly the two of them,
    once the fuzzed ids' heartbeats expired."""
    wait_until(
        lambda: not any(r["healthy"] for r in lighthouse.status()["replicas"]),
        10,
        "the fuzzed replicas' heartbeats to expire",
    )
    clients = [LighthouseClient(lighthouse.address()) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(c.quorum, f"healthy-{i}", T, step=7) for i, c in enumerate(clients)
            ]
            quorums = [f.result(timeout=30) for f in futures]
    finally:
        for c in clients:
            c.close()
    assert quorums[0].replica_ids() == quorums[1].replica_ids() == ("healthy-0", "healthy-1")


# ---- lighthouse ---------------------------------------------------------------

LIGHTHOUSE_METHODS = [f"/torchft.LighthouseService/{m}" for m in ("Quorum", "Heartbeat", "Leave")]


@FUZZ
@given(method=st.sampled_from(LIGHTHOUSE_METHODS), payload=st.binary(max_size=200))
@example(method=LIGHTHOUSE_METHODS[0], payload=b"\xff\xff\xff")  # corrupt wire format
@example(method=LIGHTHOUSE_METHODS[0], payload=b"\x0a\x05\x0a\x03\xc3\x28a")  # bad UTF-8
@example(method=LIGHTHOUSE_METHODS[1], payload=b"\x0a\x02\xc3\x28")
def test_raw_bytes_to_the_lighthouse_get_a_proper_status(lighthouse_channel, method, payload):
    code, details = raw_call(lighthouse_channel, method, payload)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), details
    assert_refused_properly(code, details)


def test_undecodable_bytes_are_invalid_argument_naming_the_message(lighthouse_channel):
    code, details = raw_call(lighthouse_channel, LIGHTHOUSE_METHODS[0], b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "LighthouseQuorumRequest" in details


def test_an_unknown_method_is_unimplemented(lighthouse_channel):
    code, _ = raw_call(lighthouse_channel, "/torchft.LighthouseService/Nope", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED


@FUZZ
@given(
    replica_id=TEXT,
    address=TEXT,
    step=INT64,
    world_size=UINT64,
    commit_failures=INT64,
    shrink_only=st.booleans(),
    data=TEXT,
)
@example(
    replica_id="r", address="", step=0, world_size=1, commit_failures=0, shrink_only=False,
    data="d" * (5 << 20),
)  # fmt: skip
def test_extreme_quorum_requests_are_answered_or_refused_with_the_field(
    lighthouse_channel, replica_id, address, step, world_size, commit_failures, shrink_only, data
):
    member = pb.QuorumMember(
        replica_id=replica_id,
        address=address,
        store_address=address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        data=data,
        commit_failures=commit_failures,
    )
    payload = pb.LighthouseQuorumRequest(requester=member).SerializeToString()
    if len(payload) > 4 << 20:
        expected = TOO_BIG
    elif not replica_id:
        expected = (grpc.StatusCode.INVALID_ARGUMENT, "replica_id")
    elif step < 0 or commit_failures < 0:
        expected = (grpc.StatusCode.INVALID_ARGUMENT, "step" if step < 0 else "commit_failures")
    else:
        expected = WAITS  # min_replicas=2: alone, it waits until its deadline
    check(lighthouse_channel, LIGHTHOUSE_METHODS[0], payload, expected)


def test_a_duplicate_replica_id_supersedes_the_earlier_call():
    """Two live calls with one replica id: the older is aborted with a reason,
    the newer one is the member."""
    # min_replicas=2 never lets the lone caller through: both must wait.
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    first, second = LighthouseClient(server.address()), LighthouseClient(server.address())
    try:
        with ThreadPoolExecutor(1) as pool:
            older = pool.submit(first.quorum, "dup", timedelta(seconds=5))
            wait_until(lambda: server.status()["replicas"], 5, "the first call at the lighthouse")
            with pytest.raises(Exception, match="(?i)deadline|no quorum"):
                second.quorum("dup", timedelta(seconds=0.3))
            with pytest.raises(Exception, match="called Quorum again"):
                older.result(timeout=10)
    finally:
        first.close()
        second.close()
        server.shutdown()


def test_the_lighthouse_serves_healthy_members_after_the_fuzzing(lighthouse, lighthouse_channel):
    healthy_pair_gets_a_quorum(lighthouse)
    # The status page still renders every (hostile) replica id it saw.
    assert lighthouse.status()["replicas"]


def test_requests_after_shutdown_fail_as_unavailable_and_waiters_are_released():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=1))
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.quorum, "waiter", timedelta(seconds=30))
            wait_until(lambda: server.status()["replicas"], 5, "the waiter at the lighthouse")
            started = time.monotonic()
            server.shutdown()
            server.shutdown()  # idempotent
            with pytest.raises(Exception):  # noqa: B017 (any error, but soon)
                waiting.result(timeout=10)
            assert time.monotonic() - started < 10
        # Refused at once, or (on a loaded machine) still connecting at the deadline.
        with pytest.raises((LighthouseUnavailableError, QuorumTimeoutError)):
            client.heartbeat("late", timedelta(seconds=1))
    finally:
        client.close()


# ---- ManagerServer ------------------------------------------------------------

# Kill is left out on purpose: it ends the process that hosts the server.
MANAGER_METHODS = [
    f"/torchft.ManagerService/{m}" for m in ("Quorum", "ShouldCommit", "CheckpointMetadata")
]


@pytest.fixture(scope="module")
def group_lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def group(group_lighthouse):
    """A replica group of two ranks whose ManagerServer takes the fuzzing."""
    server = ManagerServer(
        replica_id="fuzzed-group",
        lighthouse_addr=group_lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=2,
    )
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def group_channel(group):
    channel = grpc.insecure_channel(group.address().removeprefix("http://"))
    yield channel
    channel.close()


@FUZZ
@given(method=st.sampled_from(MANAGER_METHODS), payload=st.binary(max_size=200))
@example(method=MANAGER_METHODS[0], payload=b"\xff\xff\xff")
@example(method=MANAGER_METHODS[1], payload=b"\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
def test_raw_bytes_to_a_manager_server_get_a_proper_status(group_channel, method, payload):
    code, details = raw_call(group_channel, method, payload)
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), details
    assert_refused_properly(code, details)


@FUZZ
@given(
    group_rank=INT64,
    step=INT64,
    commit_failures=INT64,
    metadata=TEXT,
    shrink_only=st.booleans(),
    init_sync=st.booleans(),
)
def test_extreme_manager_quorum_requests_are_refused_or_time_out(
    group_channel, group_rank, step, commit_failures, metadata, shrink_only, init_sync
):
    request = pb.ManagerQuorumRequest(
        group_rank=group_rank,
        step=step,
        checkpoint_metadata=metadata,
        shrink_only=shrink_only,
        init_sync=init_sync,
        commit_failures=commit_failures,
    )
    payload = request.SerializeToString()
    if len(payload) > 4 << 20:
        expected = TOO_BIG
    elif not 0 <= group_rank < 2:
        expected = (grpc.StatusCode.INVALID_ARGUMENT, "group_rank")
    elif step < 0 or commit_failures < 0:
        expected = (grpc.StatusCode.INVALID_ARGUMENT, "step" if step < 0 else "commit_failures")
    else:
        expected = WAITS  # one rank of two asked: it waits for the other
    check(group_channel, MANAGER_METHODS[0], payload, expected)


@FUZZ
@given(group_rank=INT64, step=INT64, vote=st.booleans(), rank=INT64)
def test_extreme_commit_votes_and_metadata_requests_are_refused_or_time_out(
    group_channel, group, group_rank, step, vote, rank
):
    vote_req = pb.ShouldCommitRequest(should_commit=vote, group_rank=group_rank, step=step)
    expected = (grpc.StatusCode.INVALID_ARGUMENT, "group_rank")
    check(group_channel, MANAGER_METHODS[1], vote_req.SerializeToString(),
          expected if not 0 <= group_rank < 2 else WAITS)  # fmt: skip
    meta_req = pb.CheckpointMetadataRequest(rank=rank).SerializeToString()
    code, details = raw_call(group_channel, MANAGER_METHODS[2], meta_req, ANSWER_S)
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK), details
    assert code == grpc.StatusCode.OK or str(rank) in details


def test_the_manager_server_serves_its_group_after_the_fuzzing(group):
    clients = [ManagerClient(group.address()) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(
                    lambda r: clients[r].quorum(
                        QuorumRequest(group_rank=r, step=3, checkpoint_metadata=f"m{r}"), T
                    ),
                    range(2),
                )
            )  # fmt: skip
            votes = list(pool.map(lambda r: clients[r].should_commit(r, 3, True, T), range(2)))
        assert results[0].quorum_id == results[1].quorum_id
        assert results[0].max_step == 3 and votes == [True, True]
        assert clients[0].checkpoint_metadata(1, T) == "m1"
    finally:
        for c in clients:
            c.close()
    # Votes that timed out left nothing behind (one entry per fuzzed step would
    # grow without bound).
    assert not group._votes


def test_a_rank_that_gave_up_does_not_shorten_the_next_quorum_of_its_group(group, group_lighthouse):
    """The deadline of an abandoned call must leave with it; the group's next
    lighthouse request gets the deadline of the calls still waiting."""
    clients = [ManagerClient(group.address()) for _ in range(2)]
    peer = LighthouseClient(group_lighthouse.address())

    def ask(rank: int):  # with the rank's own metadata, as a rank's calls carry it
        return clients[rank].quorum(QuorumRequest(rank, 4, checkpoint_metadata=f"m{rank}"), T)

    def group_quorum() -> list:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(ask, range(2)))

    def peer_waiting() -> bool:
        replicas = group_lighthouse.status()["replicas"]
        return any(r["waiting"] for r in replicas if r["replica_id"] == "peer")

    try:
        with ThreadPoolExecutor(1) as pool:
            # A quorum of the group and a peer, so that the group's next one
            # must wait for the peer (fast quorum needs every previous member).
            first = pool.submit(peer.quorum, "peer", T, step=4)
            wait_until(peer_waiting, 10, "the peer to wait at the lighthouse")
            assert group_quorum()[0].replica_world_size == 2
            assert first.result(timeout=15).replica_ids() == ("fuzzed-group", "peer")

            with pytest.raises(QuorumTimeoutError):
                clients[0].quorum(QuorumRequest(0, 5), timedelta(seconds=0.2))
            time.sleep(0.3)  # well past the abandoned call's deadline

            # Late on purpose, by more than the abandoned call's 0.2 s: a group
            # request that had kept that deadline would time out first.
            late = pool.submit(lambda: (time.sleep(0.5), peer.quorum("peer", T, step=5))[1])
            results = group_quorum()
            assert late.result(timeout=15).replica_ids() == ("fuzzed-group", "peer")
        assert results[0].quorum_id == results[1].quorum_id
        assert results[0].replica_world_size == 2
    finally:
        peer.leave("peer")
        peer.close()
        for c in clients:
            c.close()


def test_a_manager_server_after_shutdown_is_unavailable(group_lighthouse):
    server = ManagerServer(
        replica_id="short-lived",
        lighthouse_addr=group_lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
    )
    server.shutdown()
    server.shutdown()  # idempotent
    client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=1))
    try:
        with pytest.raises(LighthouseUnavailableError, match="could not connect"):
            client.should_commit(0, 0, True, timedelta(seconds=1))
    finally:
        client.close()


# ---- checkpoint HTTP server -----------------------------------------------------

STAGED_STEP = 5
HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"]
TOKEN = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12)
PATH = st.one_of(
    st.just(f"/checkpoint/{STAGED_STEP}"),
    st.builds(lambda s: f"/checkpoint/{s}", st.one_of(INT64, st.text(max_size=30))),
    st.builds(
        lambda c, o: f"/checkpoint/{STAGED_STEP}?chunk={c}&of={o}",
        st.one_of(st.integers(-3, 300), st.text(max_size=5)),
        st.one_of(st.integers(-3, 300), st.text(max_size=5)),
    ),
    st.text(max_size=60).map(lambda t: "/" + t),
    st.text(max_size=60),
)
HEADER = st.tuples(
    st.sampled_from(["Range", "Content-Length", "Host", "Transfer-Encoding", "Expect", "X-Junk"]),
    st.one_of(
        st.builds(lambda a, b: f"bytes={a}-{b}", INT64, INT64),
        st.text(max_size=40),
        st.sampled_from(["chunked", "100-continue", "-1", "99999999999999999999", "x" * 70000]),
    ),
)


@pytest.fixture(scope="module")
def source():
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1")
    state = {"w": torch.arange(10, dtype=torch.float32), "step": STAGED_STEP}
    transport.send_checkpoint([1], STAGED_STEP, state, T)
    yield transport, state
    transport.shutdown()


def http_exchange(port: int, request: bytes) -> bytes:
    """Sends raw bytes; returns the final status line, after any interim 1xx
    ("100 Continue" answers an Expect header); empty if the server hung up."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before reading it all
        data = b""
        while True:
            final = [line for line in data.split(b"\r\n")[:-1] if line.startswith(b"HTTP/")]
            final = [line for line in final if not line.split(b" ")[1:2] == [b"100"]]
            if final:
                return final[0]
            chunk = sock.recv(4096)
            if not chunk:
                return b""
            data += chunk


@FUZZ
@given(
    method=st.one_of(st.sampled_from(HTTP_METHODS), TOKEN),
    path=PATH,
    headers=st.lists(HEADER, max_size=4),
)
@example(method="GET", path="http://[::1/checkpoint/5", headers=[])
@example(method="GET", path="//[/checkpoint/5", headers=[])
@example(method="GET", path=f"/checkpoint/{STAGED_STEP}?chunk=" + "9" * 5000 + "&of=2", headers=[])
@example(method="HEAD", path=f"/checkpoint/{STAGED_STEP}", headers=[])
@example(method="GET", path=f"/checkpoint/{STAGED_STEP + 1}", headers=[])  # not yet: 503
@example(method="GET", path="", headers=[])  # two words: an HTTP/0.9 request line
@example(method="GET", path="/checkpoint/9" * 10000, headers=[])
def test_bad_http_requests_get_a_4xx_and_never_a_hang_up(source, method, path, headers):
    transport, _ = source
    port = urlsplit(transport.metadata()).port
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass")
    status = http_exchange(port, request)
    assert status.startswith(b"HTTP/1."), f"no answer to {request[:200]!r}"
    code = int(status.split()[1])
    if code == 200:
        assert method == "GET" and path.startswith(f"/checkpoint/{STAGED_STEP}")
    elif code == 503:  # well formed, for a step the source has not staged yet: retried
        asked = re.fullmatch(r"(?:/torchft_like)?/checkpoint/(\d{1,19})", urlsplit(path).path)
        assert method == "GET" and asked and int(asked[1]) > STAGED_STEP, status
    elif method not in HTTP_METHODS:
        assert code == 501 or 400 <= code < 500, status  # RFC 9110: 501, method unknown
    else:
        assert 400 <= code < 500, status


def test_the_checkpoint_server_serves_a_valid_checkpoint_after_the_fuzzing(source):
    transport, state = source
    receiver = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        got = receiver.recv_checkpoint(0, transport.metadata(), STAGED_STEP, T)
    finally:
        receiver.shutdown()
    assert torch.equal(got["w"], state["w"]) and got["step"] == STAGED_STEP


def test_a_connection_that_never_sends_is_dropped_and_frees_its_thread(source, monkeypatch):
    """A peer that opens connections and goes silent must not pin server threads."""
    from torchft_like.checkpointing import http_serve

    assert 0 < http_serve.Handler.timeout <= 300
    monkeypatch.setattr(http_serve.Handler, "timeout", 0.3)  # not a minute in a test
    transport, _ = source
    port = urlsplit(transport.metadata()).port
    before = threading.active_count()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    try:
        wait_until(
            lambda: threading.active_count() <= before, 10, "the silent connections' threads to end"
        )
        for sock in silent:
            assert sock.recv(1) == b""  # the server hung up on us
    finally:
        for sock in silent:
            sock.close()


# ---- connection floods (loopback, bounded) ---------------------------------------

NUM_FLOOD = 200
"""Connections per kind of flood: bounded, loopback only."""
PROMPT_S = 3.0
"""A normal request after (and during) a flood must be answered within this."""


def hang_up_abruptly(port: int, request: bytes) -> None:
    """Sends `request` and resets the connection (SO_LINGER 0: an RST, not a
    FIN), as a client that crashed or timed out mid-request does."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
        sock.sendall(request)
    except OSError:
        pass
    sock.close()


def flood(port: int, request: bytes) -> list[socket.socket]:
    """NUM_FLOOD early hang-ups, then NUM_FLOOD idle connections (returned, still open)."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: hang_up_abruptly(port, request), range(NUM_FLOOD)))
    idle = []
    try:
        for _ in range(NUM_FLOOD):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except BaseException:
        for sock in idle:
            sock.close()
        raise
    return idle


def assert_no_traceback(caplog, capfd) -> None:
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage() for r in loud[:3]]
    assert "Traceback" not in capfd.readouterr().err


def test_a_flood_of_hang_ups_and_idle_connections_leaves_the_checkpoint_server_quiet_and_prompt(
    caplog, capfd
):
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1")
    state = {"w": torch.zeros(1 << 20)}  # 4 MB: an abrupt hang-up lands mid-body
    transport.send_checkpoint([1], STAGED_STEP, state, T)
    port = urlsplit(transport.metadata()).port
    receiver = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        with caplog.at_level(logging.DEBUG):
            idle = flood(port, f"GET /checkpoint/{STAGED_STEP} HTTP/1.1\r\n\r\n".encode())
            try:
                start = time.monotonic()
                got = receiver.recv_checkpoint(0, transport.metadata(), STAGED_STEP, T)
                assert time.monotonic() - start < PROMPT_S
                assert torch.equal(got["w"], state["w"])
            finally:
                for sock in idle:
                    sock.close()
        assert_no_traceback(caplog, capfd)
    finally:
        receiver.shutdown()
        transport.shutdown()


def test_a_flood_of_hang_ups_and_idle_connections_leaves_the_status_page_quiet_and_prompt(
    caplog, capfd
):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind="127.0.0.1:0")
    try:
        url = server.http_address()
        assert url is not None
        port = int(url.rsplit(":", 1)[1])
        with caplog.at_level(logging.DEBUG):
            idle = flood(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                start = time.monotonic()
                with urllib.request.urlopen(url + "/status.json", timeout=PROMPT_S) as answer:
                    assert answer.status == 200
                assert time.monotonic() - start < PROMPT_S
            finally:
                for sock in idle:
                    sock.close()
        assert_no_traceback(caplog, capfd)
    finally:
        server.shutdown()


def test_the_http_servers_bound_their_backlog_and_idle_connections():
    from lighthouse.status import server as status
    from lighthouse.web.server import BACKLOG, QuietHTTPServer
    from torchft_like.checkpointing import http_serve

    assert QuietHTTPServer.request_queue_size == BACKLOG >= 128
    assert issubclass(http_serve.Server, QuietHTTPServer)
    assert 0 < status.HANDLER_TIMEOUT_S <= 30
    assert 0 < http_serve.Handler.timeout <= 300


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_http_servers_sleep_without_polling_and_stop_at_once(host):
    """serve_forever waits 5 s between polls (each a thread wake-up beside
    training); shutdown must not wait for one."""
    from http.server import BaseHTTPRequestHandler

    from lighthouse.web.server import server_class

    server = server_class(host)((host, 0), BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # An answer (501: the handler has no do_GET) proves serve_forever loops.
    answering = http.client.HTTPConnection(host, server.server_address[1], timeout=10)
    try:
        answering.request("GET", "/")
        assert answering.getresponse().status == 501
    finally:
        answering.close()
    start = time.monotonic()
    server.shutdown()
    thread.join(5)
    server.server_close()
    assert not thread.is_alive() and time.monotonic() - start < 1.0
