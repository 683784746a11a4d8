"""Healing striped across three real HTTPTransport senders (threads) on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from torchft_like.checkpointing import HTTPTransport, state_format, striped
from torchft_like.checkpointing.heal_source import HealSource

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)
STEP = 7


def state(mb: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = mb * (1 << 20) // 4
    return {
        "model": {"w": torch.randn(n // 2, generator=gen), "b": torch.randn(7, generator=gen)},
        "optim": {"m": torch.randn(n - n // 2, generator=gen), "lr": 1e-3, "ids": [1, 2]},
        "torchft": {"step": STEP},
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(
            state_format.flat_bytes(a), state_format.flat_bytes(b)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def transports() -> Iterator[list[HTTPTransport]]:
    made = [HTTPTransport(timeout=T, hostname="127.0.0.1") for _ in range(4)]
    yield made
    for t in made:
        t.shutdown(wait=False)


def serve(senders: list[HTTPTransport], st: dict) -> list[tuple[int, str]]:
    for sender in senders:
        sender.send_checkpoint([9], STEP, st, T)
    return [(rank, sender.metadata()) for rank, sender in enumerate(senders)]


def test_a_striped_fetch_equals_the_state_bitwise_and_takes_a_share_from_each(transports):
    *senders, receiver = transports
    st = state()
    got = receiver.recv_checkpoint_striped(serve(senders, st), STEP, T)
    assert same(got, st)
    report = receiver.last_stripe_report
    assert report is not None and not report.errors
    assert all(n > 0 for n in report.bytes_by_source), report.summary()
    assert sum(report.bytes_by_source) == sum(t.nbytes for t in state_format.flatten(st)[1])


def test_a_sender_cut_off_mid_transfer_leaves_its_ranges_to_the_others(transports):
    """Sender 1's connections are hung up once its first bytes arrive, and it
    stops serving: the receive completes from senders 0 and 2."""
    *senders, receiver = transports
    st = state(mb=96)  # ranges of 8 MB and more than the loopback socket buffers
    sources = serve(senders, st)
    senders[1].send_checkpoint([9], STEP, st, timedelta(milliseconds=1))  # disallow cuts at once
    cut = threading.Event()

    def progress(source: int, nbytes: int) -> None:
        if source == 1 and not cut.is_set():
            cut.set()
            senders[1].disallow_checkpoint()  # hangs up its transfers in flight

    peers = [HealSource.parse(r, m) for r, m in sources]
    fetch = striped.StripedFetch(
        peers, STEP, deadline=_deadline(T), ranges_per_source=2, progress=progress
    )
    got, nbytes, report = fetch.run()
    assert cut.is_set()
    assert same(got, st)
    assert list(report.errors) == [peers[1].label], report.summary()
    assert report.refetched >= 1
    assert report.ranges_by_source[1] == []  # nothing of sender 1's counted
    assert sorted(report.ranges_by_source[0] + report.ranges_by_source[2]) == list(range(6))


def test_a_sender_that_is_gone_is_skipped(transports):
    *senders, receiver = transports
    st = state(mb=2)
    sources = serve(senders, st)
    senders[0].shutdown()  # the primary refuses connections: the others serve it all
    got = receiver.recv_checkpoint_striped(sources, STEP, T)
    assert same(got, st)
    report = receiver.last_stripe_report
    assert report is not None and list(report.errors) == [f"replica rank 0 at {sources[0][1]}"]


def test_a_source_not_serving_yet_is_waited_for_not_dropped(transports):
    """One peer stages its state late (it learns of the quorum after the
    healer asks): the others serve its ranges meanwhile, nothing is dropped."""
    *senders, receiver = transports
    st = state(mb=4)
    sources = serve(senders[:2], st) + [(2, senders[2].metadata())]
    got = receiver.recv_checkpoint_striped(sources, STEP, T)
    assert same(got, st)
    report = receiver.last_stripe_report
    assert report is not None and not report.errors, report.summary()
    assert report.bytes_by_source[2] == 0


def test_a_fetch_waits_until_some_source_serves(transports):
    *senders, receiver = transports
    st = state(mb=1)
    sources = [(rank, sender.metadata()) for rank, sender in enumerate(senders)]
    later = threading.Timer(0.3, lambda: serve(senders, st))
    later.start()
    try:
        got = receiver.recv_checkpoint_striped(sources, STEP, T)
    finally:
        later.join()
    assert same(got, st)


def test_sources_serving_different_states_are_refused(transports):
    *senders, receiver = transports
    sources = serve(senders, state(mb=1))
    other = state(mb=1)
    other["optim"]["lr"] = 2e-3  # the same tensors, another value in the tree
    senders[2].send_checkpoint([9], STEP, other, T)
    with pytest.raises(striped.LayoutMismatch, match="serves another state of step 7"):
        receiver.recv_checkpoint_striped(sources, STEP, T)


def test_one_source_is_a_plain_receive(transports):
    sender, *_, receiver = transports
    st = state(mb=1)
    got = receiver.recv_checkpoint_striped(serve([sender], st), STEP, T)
    assert same(got, st)


def _deadline(timeout: timedelta) -> float:
    return time.monotonic() + timeout.total_seconds()


def test_an_error_that_is_no_sources_fault_ends_the_fetch_at_once(transports):
    *senders, _ = transports
    sources = serve(senders, state(mb=1))
    peers = [HealSource.parse(r, m) for r, m in sources]

    def progress(source: int, nbytes: int) -> None:
        raise KeyError("a bug in the caller's callback")

    started = time.monotonic()
    with pytest.raises(KeyError, match="a bug"):
        striped.StripedFetch(peers, STEP, _deadline(T), progress=progress).run()
    assert time.monotonic() - started < 5  # not held until the deadline
