"""torchft's checkpoint URL scheme and payload over real sockets, both ways:
torchft receivers fetch from our HTTPTransport, and ours fetch from a torchft
HTTPTransport (the real one where pytorch/torchft is installed)."""

from __future__ import annotations

import importlib
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import torch

from torchft_like.checkpointing import HTTPTransport
from torchft_like.checkpointing.http_fetch import FetchRefused
from torchft_like.checkpointing.torchft_http import UnsafeStateError

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)


def streaming_load(body):
    """torch's own streaming loader, as torchft's receiver runs it (here weights_only)."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(body, weights_only=True)


def torchft_transport_class():
    module = pytest.importorskip(
        "torchft.checkpointing.http_transport",
        reason="pytorch/torchft is not installed (the bench extra installs it)",
    )
    return module.HTTPTransport


def state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(5, 3)
    momentum = {
        i: {"momentum_buffer": torch.randn_like(p)} for i, p in enumerate(model.parameters())
    }
    opt = {"state": momentum, "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]}
    return {
        "user": {"default": {"m": model.state_dict(), "o": opt}},
        "torchft": {"step": step, "batches_committed": 2 * step},
    }


def assert_identical(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert a == b


@pytest.fixture
def make():
    made: list = []

    def make_one(cls=HTTPTransport, **kwargs):
        transport = cls(T, hostname="127.0.0.1", **kwargs) if cls is HTTPTransport else cls(T, 0)
        made.append(transport)
        return transport

    yield make_one
    for transport in made:  # torchft's waits up to 0.5 s for its server's poll
        transport.shutdown(wait=isinstance(transport, HTTPTransport))


def test_a_torchft_receiver_gets_the_staged_step_in_torchs_streaming_format(make):
    source = make()
    assert source.metadata().endswith("/torchft_like/checkpoint/")
    sent = state(5)
    source.send_checkpoint([1], 5, sent, T)
    with urllib.request.urlopen(source.metadata() + "5/full", timeout=5) as body:
        assert_identical(sent, streaming_load(body))


def test_a_torchft_request_that_comes_before_its_step_is_staged_waits_for_it(make):
    source = make()
    sent = state(3)
    timer = threading.Timer(0.5, source.send_checkpoint, ([1], 3, sent, T))
    timer.start()
    started = time.monotonic()
    try:
        with urllib.request.urlopen(source.metadata() + "3/full", timeout=5) as body:
            assert_identical(sent, streaming_load(body))
    finally:
        timer.join()
    assert time.monotonic() - started >= 0.4
    with pytest.raises(urllib.error.HTTPError) as e:  # an older step: refused at once
        urllib.request.urlopen(source.metadata() + "2/full", timeout=5)
    assert e.value.code == 400 and "wrong step: serving 3" in e.value.read().decode()


def test_our_receiver_fetches_a_peer_at_torchfts_path_in_torchfts_format(make, caplog):
    source, receiver = make(), make()
    sent = state(4)
    source.send_checkpoint([1], 4, sent, T)
    origin = f"http://{urlsplit(source.metadata()).netloc}"
    torchft_style = origin + "/checkpoint/"  # what a torchft HTTPTransport advertises
    with caplog.at_level("INFO", logger="torchft_like.checkpointing.http_transport"):
        assert_identical(sent, receiver.recv_checkpoint(0, torchft_style, 4, T))
    assert "torchft's format" in caplog.text
    # An older torchft_like peer advertises the bare origin: still our own format.
    assert_identical(sent, receiver.recv_checkpoint(0, origin, 4, T))
    started = time.monotonic()
    with pytest.raises(FetchRefused, match="from torchft replica rank 0 .* wrong step"):
        receiver.recv_checkpoint(0, torchft_style, 3, T)
    assert time.monotonic() - started < 2
    with pytest.raises(ValueError, match=r"has path '/elsewhere/'; .* \(torchft\)$"):
        receiver.recv_checkpoint(0, origin + "/elsewhere/", 4, T)


def test_torchfts_own_receiver_heals_from_our_transport(make):
    theirs = make(torchft_transport_class())
    source = make()
    sent = state(6)
    source.send_checkpoint([1], 6, sent, T)
    assert_identical(sent, theirs.recv_checkpoint(0, source.metadata(), 6, T))


def test_our_receiver_heals_from_torchfts_own_transport(make):
    theirs, receiver = make(torchft_transport_class()), make()
    sent = state(8)
    theirs.send_checkpoint([1], 8, sent, T)
    assert urlsplit(theirs.metadata()).path == "/checkpoint/"
    assert_identical(sent, receiver.recv_checkpoint(0, theirs.metadata(), 8, T))
    started = time.monotonic()
    with pytest.raises(FetchRefused, match="invalid checkpoint requested, serving 8"):
        receiver.recv_checkpoint(0, theirs.metadata(), 9, T)
    assert time.monotonic() - started < 2


class LRSchedulerLike:
    """A user object in the state: torchft's receiver would unpickle it."""

    def __init__(self) -> None:
        self.last_epoch = 3


def test_a_torchft_state_that_needs_unpickling_is_refused_naming_the_peer_and_key(make):
    theirs, receiver = make(torchft_transport_class()), make()
    theirs.send_checkpoint([1], 2, {"user": {"default": LRSchedulerLike()}}, T)
    with pytest.raises(UnsafeStateError) as e:
        receiver.recv_checkpoint(1, theirs.metadata(), 2, T)
    text = str(e.value)
    assert f"torchft replica rank 1 at {theirs.metadata()}" in text and "(key 'full')" in text
    assert f"{__name__}.LRSchedulerLike" in text
    # torch's loader itself refuses it the same way: nothing here is weaker than weights_only
    serialization = importlib.import_module("torch.distributed._serialization")
    with urllib.request.urlopen(theirs.metadata() + "2/full", timeout=5) as body:
        with pytest.raises(Exception, match="Unsupported global"):
            serialization._streaming_load(body, weights_only=True)
