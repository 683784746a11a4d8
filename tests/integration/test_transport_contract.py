"""What every CheckpointTransport must do, run on each: HTTPTransport (pull,
one and four connections) and PGTransport (push, over a real 2-rank gloo
process group whose ranks are threads). The sending end runs in a thread of
its own, as it runs in another process in a job: a push transport's send
returns only once its receiver has taken the state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from tests.integration.test_http_transport import assert_identical, rich_state
from torchft_like import ProcessGroupGloo
from torchft_like.checkpointing import CheckpointTransport, HTTPTransport
from torchft_like.checkpointing.pg_transport import PGTransport

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=5)
SHORT = timedelta(seconds=0.5)


class Sender:
    """`send_checkpoint` in a thread; `join` re-raises what it raised."""

    def __init__(self, send: Callable[[], None], delay: float = 0.0) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Timer(delay, self._run, args=(send,))
        self.thread.start()

    def _run(self, send: Callable[[], None]) -> None:
        try:
            send()
        except BaseException as e:  # noqa: BLE001 (re-raised in join)
            self.error = e

    def join(self) -> None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "send_checkpoint did not return"
        if self.error is not None:
            raise self.error


class CheckpointTransportContract:
    """Subclass and define `pair`: (source at replica rank 0, receiver at 1)."""

    __test__ = False

    def pair(self) -> tuple[CheckpointTransport, CheckpointTransport]:
        raise NotImplementedError

    @pytest.fixture(autouse=True)
    def _cleanup(self) -> Iterator[None]:
        self.cleanups: list[Callable[[], None]] = []
        yield
        for cleanup in reversed(self.cleanups):
            cleanup()

    def send(self, source: CheckpointTransport, step: int, state: object, delay: float = 0.0):
        return Sender(lambda: source.send_checkpoint([1], step, state, T), delay)

    def test_a_state_dict_round_trips_bit_identical(self):
        source, receiver = self.pair()
        state = rich_state()
        sender = self.send(source, 10, state)

        assert_identical(state, receiver.recv_checkpoint(0, source.metadata(), 10, T))
        sender.join()

    def test_a_large_tensor_read_in_several_pieces_round_trips_bit_identical(self):
        source, receiver = self.pair()
        state = {"embedding": torch.arange(20_000_000, dtype=torch.int32), "tail": torch.ones(3)}
        sender = self.send(source, 2, state)

        assert_identical(state, receiver.recv_checkpoint(0, source.metadata(), 2, T))
        sender.join()

    def test_a_request_for_a_step_the_source_moved_past_fails_at_once(self):
        source, receiver = self.pair()
        sender = self.send(source, 10, rich_state())
        start = time.monotonic()

        with pytest.raises(RuntimeError, match=r"step 9\b.*serving (step )?10\b"):
            receiver.recv_checkpoint(0, source.metadata(), 9, timedelta(seconds=20))
        assert time.monotonic() - start < 2, "a wrong step cannot change: no retries"
        sender.join()  # the refusal does not leave the source waiting

    def test_with_nothing_served_the_receiver_times_out_naming_the_step(self):
        source, receiver = self.pair()
        source.disallow_checkpoint()
        start = time.monotonic()

        with pytest.raises(RuntimeError, match=r"step 10\b.*(within 0.5 s|timed out)"):
            receiver.recv_checkpoint(0, source.metadata(), 10, SHORT)
        assert time.monotonic() - start < 2

    def test_the_receiver_waits_until_the_source_stages(self):
        source, receiver = self.pair()
        state = rich_state()
        sender = self.send(source, 4, state, delay=0.3)

        assert_identical(state, receiver.recv_checkpoint(0, source.metadata(), 4, T))
        sender.join()


class TestHTTPTransport(CheckpointTransportContract):
    __test__ = True
    receiver_chunks = 0

    def make(self, **kwargs) -> HTTPTransport:
        transport = HTTPTransport(timeout=T, hostname="127.0.0.1", **kwargs)
        self.cleanups.append(transport.shutdown)
        return transport

    def pair(self) -> tuple[CheckpointTransport, CheckpointTransport]:
        return self.make(), self.make(num_chunks=self.receiver_chunks)


class TestHTTPTransportInFourChunks(TestHTTPTransport):
    receiver_chunks = 4


class TestPGTransport(CheckpointTransportContract):
    __test__ = True

    def pair(self) -> tuple[CheckpointTransport, CheckpointTransport]:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pgs = [ProcessGroupGloo(timeout=T) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:  # configure waits for every rank
            list(pool.map(lambda r: pgs[r].configure(f"127.0.0.1:{store.port}/c", "0", r, 2),
                          range(2)))  # fmt: skip
        for pg in pgs:
            self.cleanups.append(pg.shutdown)
        source, receiver = (PGTransport(pg, T, torch.device("cpu")) for pg in pgs)
        return source, receiver
