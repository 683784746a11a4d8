"""HTTPTransport over real HTTP on 127.0.0.1: round trips, refusals, hostile peers."""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import pickle
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import torch

from lighthouse.core.views import QuorumResult
from torchft_like.checkpointing import HTTPTransport, http_fetch, state_format
from torchft_like.checkpointing.transport import capable
from torchft_like.manager.heal_plan import transfer_plan
from torchft_like.manager.healing import receive_state

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=5)
SHORT = timedelta(seconds=0.5)


def rich_state() -> dict:
    return {
        "model": {
            "w32": torch.randn(3, 4),
            "w16": torch.randn(5).half(),
            "wbf": torch.randn(2, 2).bfloat16(),
            "ids": torch.arange(6, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "bytes": torch.arange(4, dtype=torch.uint8),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 3),
            "strided": torch.randn(4, 4).t(),
            "big": torch.randn(300_000),  # spans several chunks
        },
        "optim": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "torchft": {"step": 10, "batches_committed": 20, "name": "x", "nan": float("nan")},
    }


def assert_identical(a, b) -> None:
    assert type(a) is type(b) or isinstance(a, torch.Tensor)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
        assert torch.equal(state_format.flat_bytes(a), state_format.flat_bytes(b)), "bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


@pytest.fixture
def make() -> Iterator:
    made: list[HTTPTransport] = []

    def make(**kwargs) -> HTTPTransport:
        made.append(HTTPTransport(timeout=kwargs.pop("timeout", T), hostname="127.0.0.1", **kwargs))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown()


def test_metadata_is_the_url_peers_reach_and_defaults_to_the_host_name(make):
    assert make().metadata().startswith("http://127.0.0.1:")
    default = HTTPTransport(timeout=T)
    try:
        assert default.metadata().startswith(f"http://{socket.gethostname()}:")
    finally:
        default.shutdown()


def test_an_unreachable_source_is_a_clear_error_within_the_timeout(make):
    with socket.socket() as s:  # a port that was free a moment ago: nobody listens
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()

    with pytest.raises(RuntimeError, match=rf"step 3 .*at {address} within 1 s.*ConnectionRefused"):
        make().recv_checkpoint(0, address, 3, timedelta(seconds=1))
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("torchft_peer", [False, True])
def test_a_source_that_died_fails_the_heal_within_a_second_not_the_timeout(make, torchft_peer):
    """A dead source's port refuses connections: one second of that, not the
    transfer timeout (torchtitan's 60 s), ends the heal, naming why."""
    source = make()
    source.send_checkpoint([1], 3, rich_state(), T)
    metadata = source.metadata()
    if torchft_peer:  # a torchft source's address, fetched in its own format
        metadata = metadata.replace("/torchft_like/checkpoint/", "/checkpoint/")
    source.shutdown()  # its port closes, as when its process dies
    start = time.monotonic()

    with pytest.raises(RuntimeError, match=r"refused every connection for 1 s .*process is gone"):
        make().recv_checkpoint(0, metadata, 3, timedelta(seconds=30))
    assert time.monotonic() - start < 3


def test_a_wrong_step_is_torchfts_http_error_400_and_a_runtime_error(make):
    source = make()
    source.send_checkpoint([1], 2345, {"w": torch.ones(2)}, T)

    with pytest.raises(urllib.error.HTTPError, match=r"Error 400.*serving 2345 but got step=1234"):
        make().recv_checkpoint(0, source.metadata(), 1234, T)


def test_a_step_ahead_of_the_staged_one_is_waited_for_not_refused(make):
    """The source may still serve its last step when a healer asks for the
    quorum's (torchft's multi-recovery test does exactly this)."""
    source = make()
    source.send_checkpoint([1], 1, {"w": torch.zeros(2)}, T)
    nxt = {"w": torch.ones(2)}
    timer = threading.Timer(0.3, source.send_checkpoint, ([1], 2, nxt, T))
    timer.start()
    try:
        assert_identical(nxt, make().recv_checkpoint(0, source.metadata(), 2, T))
    finally:
        timer.join()


@pytest.mark.parametrize("timeout_s", [0.0, 0.2])
def test_a_step_not_served_retries_to_the_deadline_then_is_a_timed_out_url_error(make, timeout_s):
    source = make()  # nothing staged: 503, which staging could change
    start = time.monotonic()

    with pytest.raises(
        urllib.error.URLError, match=r"urlopen error timed out: could not fetch step 3 "
    ) as e:
        make().recv_checkpoint(0, source.metadata(), 3, timedelta(seconds=timeout_s))
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, TimeoutError)
    assert timeout_s - 0.06 <= time.monotonic() - start < timeout_s + 1  # last retry 50 ms early


def test_malformed_metadata_is_a_value_error(make):
    with pytest.raises(ValueError, match="'127.0.0.1:80' of replica rank 0 has no scheme"):
        make().recv_checkpoint(0, "127.0.0.1:80", 3, T)


def test_unsupported_values_fail_in_send_checkpoint_naming_their_path(make):
    with pytest.raises(TypeError, match=r"state\['model'\]\['fn'\]: values of type function"):
        make().send_checkpoint([1], 1, {"model": {"fn": lambda: 0}}, T)


def test_disallow_waits_for_a_transfer_in_flight(make):
    source = make()
    big = {"w": torch.randn(16 << 20)}  # 64 MB: more than the socket buffers hold
    original = big["w"].clone()
    source.send_checkpoint([1], 1, big, T)
    response = urllib.request.urlopen(source.metadata() + "1", timeout=5)
    first = response.read(1)  # the transfer is now in flight, stalled on us
    disallowed = threading.Event()
    threading.Thread(target=lambda: (source.disallow_checkpoint(), disallowed.set())).start()

    assert not disallowed.wait(0.3), "disallow returned while a transfer was reading the state"
    data = first + response.read()
    assert disallowed.wait(5)
    big["w"].zero_()  # the "optimizer" writes only after disallow returned
    tensor_bytes = data[-original.numel() * 4 - 4 : -4]  # then one checksum
    received = torch.frombuffer(bytearray(tensor_bytes), dtype=torch.float32)
    assert torch.equal(received, original)


def test_disallow_cuts_off_a_transfer_stalled_past_the_timeout(make):
    source = make()
    source.send_checkpoint([1], 1, {"w": torch.randn(16 << 20)}, timedelta(seconds=0.3))
    response = urllib.request.urlopen(source.metadata() + "1", timeout=5)
    response.read(1)
    start = time.monotonic()
    source.disallow_checkpoint()

    assert 0.2 < time.monotonic() - start < 2
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        response.read()


@pytest.mark.parametrize("use_madvise", [True, False])
def test_the_prefaulter_never_writes_a_piece_a_reader_has_claimed(monkeypatch, use_madvise):
    monkeypatch.setattr(http_fetch, "SLICE", 16 << 10)  # many pieces, many races
    monkeypatch.setattr(http_fetch.Prefaulter, "use_madvise", use_madvise)
    monkeypatch.setattr(http_fetch.Prefaulter, "_MIN_TENSOR_BYTES", 1)
    tensors = [torch.empty(3 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)]
    nbytes = [t.numel() for t in tensors]
    streams = [
        http_fetch.pieces(nbytes, lo, hi) for lo, hi in state_format.chunk_ranges(4 << 20, 2)
    ]
    prefaulter = http_fetch.Prefaulter(tensors, streams)
    for piece in streams[0] + streams[1]:  # a reader "receives" each piece
        prefaulter.claim(piece)
        index, lo, hi = piece
        tensors[index][lo:hi] = 0xAB
    prefaulter.stop()

    assert all(bool((t == 0xAB).all()) for t in tensors)


def serve_body(body: bytes, status: int = 200) -> http.server.ThreadingHTTPServer:
    """A hostile or broken peer that answers every GET with `status` and `body`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


def stream(doc: dict, data: bytes = b"") -> bytes:
    body = json.dumps({"checksum": "crc32c", **doc}).encode()
    return state_format.PREFIX.pack(state_format.MAGIC, len(body)) + body + data


@pytest.mark.parametrize(
    "body, message",
    [
        (pickle.dumps({"w": torch.zeros(2)}), "not a torchft_like state stream"),
        (
            stream(
                {
                    "format": 2,
                    "step": 1,
                    "tree": {
                        "tensor": {"dtype": "object", "shape": [1], "nbytes": 8, "device": "cpu"}
                    },  # fmt: skip
                },
                b"\0" * 8,
            ),
            "unknown dtype 'object'",
        ),
        (stream({"format": 2, "step": 2, "tree": None}), "the header is of step 2"),
        (
            stream({"format": 2, "step": 1, "tree": None}, b"extra"),
            "has 5 bytes after its header, not 0 of data and 0 of checksums",
        ),
    ],
)
def test_a_malicious_or_broken_stream_is_refused(make, body, message):
    server = serve_body(body)
    try:
        with pytest.raises(ValueError, match=message):
            make().recv_checkpoint(0, f"http://127.0.0.1:{server.server_address[1]}", 1, T)
    finally:
        server.shutdown()
        server.server_close()


def test_a_peer_that_is_not_a_checkpoint_server_fails_at_once_naming_it(make):
    server = serve_body(b"no such page", status=404)
    address = f"http://127.0.0.1:{server.server_address[1]}"
    start = time.monotonic()
    try:
        with pytest.raises(
            http_fetch.FetchRefused, match=rf"step 1 .* at {address}: .*HTTP 404: no such page"
        ) as e:
            make().recv_checkpoint(0, address, 1, T)
        assert isinstance(e.value, RuntimeError) and e.value.code == 404
        assert time.monotonic() - start < 2
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "path, code, message",
    [
        ("/nope", 404, "unknown path '/nope'"),
        ("/checkpoint/x", 404, "use /checkpoint/{step}"),
        ("/checkpoint/1?chunk=4&of=4", 400, "needs 0 <= chunk < of"),
        ("/checkpoint/1?chunk=a&of=4", 400, "bad query"),
        ("/checkpoint/1?of=4", 400, "bad query"),
        ("/checkpoint/1/metadata", 400, "serves torchft's checkpoint format whole only"),
        ("/torchft_like/checkpoint/1/0", 400, "key '0' is not served"),
        ("/torchft_like/checkpoint/0", 400, "wrong step: serving 1"),
        ("/torchft_like/checkpoint/2", 503, "not serving step 2 yet: serving 1"),
    ],
)
def test_a_bad_request_gets_a_clear_4xx(make, path, code, message):
    source = make()
    source.send_checkpoint([1], 1, {"w": torch.zeros(1)}, T)
    origin = f"http://{urlsplit(source.metadata()).netloc}"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(origin + path, timeout=5)
    assert e.value.code == code
    assert message in e.value.read().decode()


def test_shutdown_is_idempotent_and_stops_the_server(make):
    transport = make()
    port = urlsplit(transport.metadata()).port
    transport.shutdown()
    transport.shutdown()
    assert not transport._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_port_in_use_is_a_clear_error(make):
    port = urlsplit(make().metadata()).port
    with pytest.raises(OSError, match=f"cannot listen on port {port}.*port=0"):
        make(port=port)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_chunks": -1}, r"num_chunks \(-1\) must be in"),
        ({"port": 70000}, r"port \(70000\) must be in"),
        ({"timeout": timedelta(0)}, "must be positive"),
    ],
)
def test_bad_arguments_are_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HTTPTransport(**{"timeout": T, **kwargs})


class _Delegating:
    """A user's wrapper written for torchft's four-argument recv_checkpoint,
    forwarding every other attribute to the transport it wraps."""

    def __init__(self, inner: HTTPTransport) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        self.calls += 1
        return self.inner.recv_checkpoint(src_rank, metadata, step, timeout)


def test_a_delegating_wrapper_heals_with_the_torchft_shaped_call(make):
    source, wrapper = make(), _Delegating(make())
    state = {"w": torch.arange(6.0)}
    source.send_checkpoint([1], 5, state, T)
    result = QuorumResult(
        quorum_id=1,
        replica_rank=1,
        replica_world_size=2,
        store_address="",
        max_step=5,
        max_replica_rank=None,
        max_world_size=1,
        heal=True,
        recover_src_manager_address="manager:0",
        recover_src_replica_rank=0,
        recover_src_replica_ranks=(0,),
        recover_src_manager_addresses=("manager:0",),
    )
    assert wrapper.reports_begun and wrapper.can_stripe  # what the attributes forward
    assert not capable(wrapper, "reports_begun") and not capable(wrapper, "can_stripe")
    plan = transfer_plan(result, 1)
    log = logging.LoggerAdapter(logging.getLogger("test.heal"), {})
    heal = receive_state(
        wrapper, result, plan, T, lambda address: source.metadata(), lambda: None, log
    )
    assert wrapper.calls == 1
    assert_identical(heal.state, state)
    source.disallow_checkpoint()
