"""A corrupted or truncated healing transfer is refused and retried, never applied.

Faults are injected by a real TCP proxy between the receiver and a real
HTTPTransport source: it flips one byte of, or cuts, the first responses.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
import torch

from torchft_like.checkpointing import HTTPTransport

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)
FAULT_AT = 600_000
"""A response byte offset past the HTTP and JSON headers: inside tensor data."""


class FaultyProxy:
    """Relays TCP to `target`; the first `faulty` connections get `fault`,
    the others `then`.

    fault "flip" inverts the response byte at FAULT_AT; "cut" closes both
    sides once FAULT_AT response bytes have passed; "stall" relays no more
    from there until the proxy closes.
    """

    def __init__(
        self, target: tuple[str, int], fault: str, faulty: int, then: str | None = None
    ) -> None:
        self.target, self.fault, self.faulty, self.then = target, fault, faulty, then
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            fault = self.fault if self.connections <= self.faulty else self.then
            upstream = socket.create_connection(self.target)
            for args in ((client, upstream, None), (upstream, client, fault)):
                thread = threading.Thread(target=self._pipe, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pipe(self, src: socket.socket, dst: socket.socket, fault: str | None) -> None:
        passed = 0
        try:
            while data := src.recv(1 << 16):
                if fault and passed <= FAULT_AT < passed + len(data):
                    if fault in ("cut", "stall"):
                        dst.sendall(data[: FAULT_AT - passed])
                        if fault == "stall":
                            self._stopped.wait()
                        break
                    data = bytearray(data)
                    data[FAULT_AT - passed] ^= 0xFF
                passed += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()


@pytest.fixture
def source() -> Iterator[tuple[HTTPTransport, dict]]:
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1")
    state = {"model": {"w": torch.randn(1 << 20), "b": torch.randn(7)}, "step": 3}
    transport.send_checkpoint([1], 3, state, T)
    yield transport, state
    transport.shutdown()


def proxy_to(
    transport: HTTPTransport, fault: str, faulty: int, then: str | None = None
) -> FaultyProxy:
    port = urlsplit(transport.metadata()).port
    return FaultyProxy(("127.0.0.1", port), fault, faulty, then)


def fetch_error(proxy: FaultyProxy, timeout_s: float) -> str:
    """The error of fetching step 3 as replica rank 7 through `proxy`; closes it."""
    receiver = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        with pytest.raises(RuntimeError) as e:
            receiver.recv_checkpoint(7, proxy.url, 3, timedelta(seconds=timeout_s))
    finally:
        receiver.shutdown()
        proxy.close()
    return str(e.value)


@pytest.mark.parametrize("fault", ["flip", "cut"])
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_a_corrupted_or_truncated_transfer_is_refused_then_retried_intact(
    source, fault, num_chunks, caplog
):
    transport, state = source
    proxy = proxy_to(transport, fault, faulty=1)
    receiver = HTTPTransport(timeout=T, hostname="127.0.0.1", num_chunks=num_chunks)
    try:
        with caplog.at_level(logging.WARNING):
            got = receiver.recv_checkpoint(0, proxy.url, 3, T)
    finally:
        receiver.shutdown()
        proxy.close()

    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(got["model"]["b"], state["model"]["b"])
    assert proxy.connections == 2 * num_chunks  # one failed attempt, one good one
    if fault == "flip" and num_chunks == 1:
        assert "refused step 3" in caplog.text
        assert "tensor state['model']['w'] bytes [0, 4194304)" in caplog.text


def test_an_attempt_the_deadline_cuts_short_keeps_the_reason_the_others_failed(source):
    # The deadline lands mid-transfer (a loaded machine, a slow link): the
    # error still says why the attempts before it failed, not "timed out".
    message = fetch_error(proxy_to(source[0], "flip", faulty=1, then="stall"), 2)
    assert "(2 attempts); last answer: ChecksumMismatch: tensor state['model']['w']" in message


def test_a_transfer_corrupted_on_every_attempt_is_never_applied_and_named(source):
    proxy = proxy_to(source[0], "flip", faulty=1_000)
    message = fetch_error(proxy, 3)
    assert f"replica rank 7 at {proxy.url} within 3 s" in message
    assert "ChecksumMismatch: tensor state['model']['w'] bytes [0, 4194304) of 4194304" in message
    assert f"from {proxy.url} has crc32c" in message
    assert "the state was not applied" in message
    assert proxy.connections >= 2
