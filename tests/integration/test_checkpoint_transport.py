"""HTTPTransport round trips over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import struct
import threading
import time
import urllib.request
from datetime import timedelta

import pytest
import torch

from torchft_like.checkpointing import HTTPTransport, _format

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=5)


@pytest.fixture
def make_transport():
    made = []

    def make(**kwargs) -> HTTPTransport:
        transport = HTTPTransport(timeout=T, hostname="127.0.0.1", **kwargs)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.shutdown()


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
        },
        "optim": {
            "state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "torchft": {"step": 10, "batches_committed": 20, "name": "x"},
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_round_trip_is_bit_identical_for_every_dtype_and_container(make_transport, num_chunks):
    source, receiver = make_transport(), make_transport(num_chunks=num_chunks)
    state = rich_state()
    source.send_checkpoint([1], 10, state, T)
    got = receiver.recv_checkpoint(0, source.metadata(), 10, T)
    assert_same(state, got)


def test_a_request_for_another_step_is_refused_never_stale(make_transport):
    source, receiver = make_transport(), make_transport()
    source.send_checkpoint([1], 10, rich_state(), T)
    with pytest.raises(RuntimeError, match="step 11 is not served; serving step 10"):
        receiver.recv_checkpoint(0, source.metadata(), 11, timedelta(seconds=0.5))


def test_after_disallow_the_receiver_is_told_not_serving(make_transport):
    source, receiver = make_transport(), make_transport()
    source.send_checkpoint([1], 10, rich_state(), T)
    source.disallow_checkpoint()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not serving"):
        receiver.recv_checkpoint(0, source.metadata(), 10, timedelta(seconds=0.5))
    assert time.monotonic() - start < 2


def test_the_receiver_waits_for_the_source_to_stage(make_transport):
    source, receiver = make_transport(), make_transport()
    state = rich_state()
    threading.Timer(0.3, source.send_checkpoint, args=([1], 4, state, T)).start()
    assert_same(state, receiver.recv_checkpoint(0, source.metadata(), 4, T))


def test_an_unreachable_source_is_a_clear_error_within_the_timeout(make_transport):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="127.0.0.1:1"):
        make_transport().recv_checkpoint(0, "http://127.0.0.1:1", 3, timedelta(seconds=1))
    assert time.monotonic() - start < 3


def test_disallow_waits_for_a_transfer_in_flight(make_transport):
    source = make_transport()
    big = {"w": torch.randn(16 << 20)}  # 64 MB: more than the socket buffers hold
    original = big["w"].clone()
    source.send_checkpoint([1], 1, big, T)
    response = urllib.request.urlopen(
        source.metadata() + "/checkpoint/1/data?chunk=0&of=1", timeout=5
    )
    first = response.read(1)  # the transfer is now in flight, stalled on us
    disallowed = threading.Event()
    threading.Thread(target=lambda: (source.disallow_checkpoint(), disallowed.set())).start()
    assert not disallowed.wait(0.3), "disallow returned while a transfer was reading the state"
    data = first + response.read()
    assert disallowed.wait(5)
    big["w"].zero_()  # the "optimizer" writes only after disallow returned
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32), original)


def test_unsupported_values_are_named_by_their_path():
    with pytest.raises(TypeError, match=r"state.model.fn: values of type function"):
        _format.flatten({"model": {"fn": lambda: 0}})


@pytest.mark.parametrize(
    "header, message",
    [
        (
            {"__tensor__": 0, "dtype": "object", "shape": [1], "nbytes": 8, "device": "cpu"},
            "unknown dtype",
        ),
        (
            {"__tensor__": 0, "dtype": "float32", "shape": [2], "nbytes": 4, "device": "cpu"},
            "nbytes",
        ),
        (
            {"__tensor__": 0, "dtype": "float32", "shape": [-1], "nbytes": 4, "device": "cpu"},
            "bad shape",
        ),
        (
            {"__tensor__": 3, "dtype": "float32", "shape": [1], "nbytes": 4, "device": "cpu"},
            "indices",
        ),
    ],
)
def test_a_malformed_header_is_refused(header, message):
    with pytest.raises(ValueError, match=message):
        _format.tensor_specs(header)


def test_a_pickle_payload_is_never_unpickled(make_transport):
    """A server answering pickle bytes as the header is refused as JSON."""
    import http.server

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"\x80\x04\x95" + struct.pack("<Q", 1) + b"cos\nsystem\n."
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises((ValueError, UnicodeDecodeError, json.JSONDecodeError)):
            make_transport().recv_checkpoint(
                0, f"http://127.0.0.1:{server.server_address[1]}", 1, T
            )
    finally:
        server.shutdown()
        server.server_close()


def test_unknown_paths_get_a_helpful_404(make_transport):
    source = make_transport()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(source.metadata() + "/nope", timeout=5)
    assert e.value.code == 404
