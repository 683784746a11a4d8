"""Client channels of the project's gRPC services: options, auth, TLS, reachability."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import grpc
from grpc import aio

from lighthouse.rpc import auth
from lighthouse.rpc.address import parse_bind
from lighthouse.rpc.errors import LighthouseUnavailableError, from_rpc_error
from lighthouse.rpc.tls import FIX, TLSConfig, probe

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Keep idle connections alive, so the per-step call never pays a reconnect.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC's default reconnect backoff grows to 120 s: a lighthouse restarted
    # after a short outage would stay unreachable for minutes. Retry every
    # 100 ms (one heartbeat period; with a 1 s cap a restart cost up to 1 s
    # more, bench.lighthouse_restart): refused connections cost little.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
    # The least time one connection attempt may take (gRPC's name misleads):
    # a slow handshake (TLS, a loaded peer) must not time out at 100 ms.
    ("grpc.min_reconnect_backoff_ms", 2000),
]


def blocking_channel(
    target: str, secret: str | None, tls: TLSConfig | None = None, job: str | None = None
) -> grpc.Channel:
    """A channel to `target` (`host:port`) whose every call carries the
    secret and names `job` (a lighthouse's: lighthouse.core.jobs); TLS with
    `tls` (the server's certificate must be valid for the host of `target`),
    plaintext without."""
    if tls is None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(target, tls.channel_credentials(), options=CHANNEL_OPTIONS)
    return auth.intercept_channel(channel, secret, job)


def aio_channel(
    target: str, secret: str | None, tls: TLSConfig | None = None, job: str | None = None
) -> aio.Channel:
    """asyncio twin of `blocking_channel`."""
    interceptors = auth.aio_client_interceptors(secret, job)
    if tls is None:
        return aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return aio.secure_channel(
        target, tls.channel_credentials(), options=CHANNEL_OPTIONS, interceptors=interceptors
    )


def tls_refusal(target: str, what: str, tls: TLSConfig, timeout_s: float) -> Exception | None:
    """The error for a TLS handshake with `target` that fails, or None if it works.

    gRPC reports a failed handshake as a connection that never becomes ready
    (UNAVAILABLE, or a wait until the connect timeout); this names the cause.
    """
    host, port = parse_bind(target)
    why = probe(host, port, tls, timeout_s)
    if why is None:
        return None
    return LighthouseUnavailableError(f"cannot connect to {what} over TLS: {why}; {FIX}")


def unreachable(
    what: str, connect_timeout: timedelta, cause: Exception | None = None
) -> LighthouseUnavailableError:
    why = f" ({cause})" if cause else ""
    return LighthouseUnavailableError(
        f"could not connect to {what} within {connect_timeout.total_seconds():.1f} s{why}; "
        "is it running, and is the address right?"
    )


def check_reachable(
    target: str, what: str, connect_timeout: timedelta, tls: TLSConfig | None = None
) -> None:
    """Connects to `target` with plain TCP, retrying until `connect_timeout`;
    with `tls`, then checks that a TLS handshake succeeds (`tls_refusal`).

    Retried because a refused connection fails at once, and a lighthouse
    started a few seconds after its replicas must not fail them. A plain
    socket, not grpc.channel_ready_future: the latter starts a
    connectivity-polling thread that can deadlock a later channel.close().

    Raises:
        LighthouseUnavailableError: nothing accepted the connection in time,
            or the TLS handshake failed (the text says why and what to set).
    """
    host, port = parse_bind(target)
    deadline = time.monotonic() + connect_timeout.total_seconds()
    backoff_s = 0.05
    while True:
        left_s = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(left_s, 0.001)).close()
            break
        except OSError as e:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise unreachable(what, connect_timeout, e) from None
            time.sleep(min(backoff_s, left_s))
            backoff_s = min(backoff_s * 2, 0.5)
    if tls is not None:
        refused = tls_refusal(target, what, tls, max(deadline - time.monotonic(), 1.0))
        if refused is not None:
            raise refused


class BlockingCalls:
    """Blocking calls to one gRPC server, as both of our blocking clients
    make them (LighthouseClient, ManagerClient): the server is checked
    reachable (`check_reachable`) before the first call and again after one
    found it unavailable, and a failed call raises our error naming `peer`.

    Args:
        target: `host:port`.
        peer: how errors name the server, e.g. "lighthouse http://h:29510".
    """

    def __init__(
        self,
        target: str,
        peer: str,
        connect_timeout: timedelta,
        secret: str | None,
        tls: TLSConfig | None,
        job: str | None = None,
    ) -> None:
        self.peer = peer
        self.channel = blocking_channel(target, secret, tls, job)
        """For the caller's stub."""
        self._target = target
        self._connect_timeout = connect_timeout
        self._tls = tls
        self._connected = False

    def call(
        self,
        method: Any,
        request: Any,
        timeout_s: float,
        what: str,
        tolerated: tuple[grpc.StatusCode, ...] = (),
    ) -> Any:
        """`method(request)` within `timeout_s`; None for a `tolerated` status.

        Raises:
            LighthouseUnavailableError, QuorumError, ValueError, ...: the
                call failed (lighthouse.rpc.errors.from_rpc_error names `what`).
        """
        if not self._connected:
            check_reachable(self._target, self.peer, self._connect_timeout, self._tls)
            self._connected = True
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            self._connected = code != grpc.StatusCode.UNAVAILABLE
            if code in tolerated:
                return None
            raise from_rpc_error(e, self.peer, what) from None

    def close(self) -> None:
        self.channel.close()
