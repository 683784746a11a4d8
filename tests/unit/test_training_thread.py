"""The quorum thread's reads of the state run on the training thread."""

from __future__ import annotations

import threading

import pytest

from torchft_like.manager import threads
from torchft_like.manager.training_thread import TrainingThreadReads


def in_thread(reads: TrainingThreadReads, fn) -> dict:
    """Runs `fn` in a quorum-like thread; out["done"] is set (waking the
    training thread, as the Manager's events do) when it has returned."""
    out: dict = {"done": reads.event()}

    def run() -> None:
        threads.take(threads.QUORUM)
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
        out["done"].set()

    t = threading.Thread(target=run)
    t.start()
    out["thread"] = t
    return out


def test_a_read_runs_on_the_thread_that_waits_and_the_wait_ends_when_done():
    reads = TrainingThreadReads()
    ready = reads.event()
    out = in_thread(reads, lambda: reads.read(threading.get_ident, 10))
    reads.wait(out["done"].is_set)  # serves the read, then returns
    out["thread"].join(10)
    assert out["value"] == threading.get_ident()
    setter = threading.Timer(0.05, ready.set)
    setter.start()
    reads.wait(ready.is_set)  # woken by the event alone
    assert ready.is_set()


def test_the_readers_error_reaches_the_quorum_thread():
    reads = TrainingThreadReads()

    def fails() -> None:
        raise ValueError("no state")

    out = in_thread(reads, lambda: reads.read(fails, 10))
    reads.wait(out["done"].is_set)
    assert isinstance(out["error"], ValueError)


def test_a_read_nobody_serves_times_out_naming_why_and_is_withdrawn():
    reads, ran = TrainingThreadReads(), []
    out = in_thread(reads, lambda: reads.read(lambda: ran.append(1), 0.1))
    out["thread"].join(10)
    assert isinstance(out["error"], TimeoutError)
    assert "training thread made no Manager call within 0.1 s" in str(out["error"])
    reads.wait(lambda: True)  # a later wait does not run the withdrawn read
    assert ran == []


def test_a_read_asked_by_the_training_thread_itself_is_refused_naming_both_threads():
    """It would wait for itself until the timeout: refused at once instead."""
    with pytest.raises(RuntimeError, match="runs on the quorum thread, not on the training"):
        TrainingThreadReads().read(lambda: None, 10)
