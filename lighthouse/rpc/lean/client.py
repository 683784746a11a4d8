"""gRPC calls over one HTTP/2 connection of our own, on the caller's loop.

Why not grpc.aio for the Quorum call a group makes every step: one call
wakes grpc's poller and event-engine threads and hops to the loop, ~1-2 ms
of CPU a step here, against a fraction of that for one write and one read
on the loop itself (bench/NOTES.md, "Step overhead, round three"). The same
holds for each heartbeat on a stream (~0.7 ms through grpc.aio), so
streaming calls go here too: one DATA frame per message each way, over
lighthouse.rpc.h2.client_connection.

Anything this client does not handle (no connection, a message larger
than the peer's window, a connection lost before the answer) raises
`Unavailable`, and the caller makes the same call through grpcio instead,
which owns waiting for a server that is down. A status the server answers
raises `CallFailed` with its code and text, as grpcio would.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from lighthouse.rpc.h2.frames import literal
from lighthouse.rpc.lean.client_calls import CallFailed as CallFailed
from lighthouse.rpc.lean.client_calls import GrpcConnection, StreamingCall
from lighthouse.rpc.lean.client_calls import Unavailable as Unavailable

CONNECT_S = 1.0
"""Longest a connection attempt may take (a loopback or LAN connect takes
milliseconds): past it the call goes through grpcio with the time left."""
RETRY_AFTER_S = 10.0
"""After a failed connection attempt, calls go through grpcio this long."""
PROXY_ENV = ("grpc_proxy", "https_proxy", "http_proxy")
"""Where grpcio (gRPC core) finds an HTTP CONNECT proxy, the first one set."""
NO_PROXY_ENV = ("no_grpc_proxy", "no_proxy")
"""Where it finds the hosts it reaches directly, the first one set."""
OTHER_PROXY_ENV = ("GRPC_PROXY", "HTTPS_PROXY", "HTTP_PROXY", "GRPC_ADDRESS_HTTP_PROXY")
"""Names gRPC core does not read as above (upper case) or reads with rules of
their own (a proxy by address): set, they make this client stand aside."""


def usable(target: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether calls to `target` (host:port) may take this path: only where
    grpcio would connect directly, since this client knows no proxy.

    grpcio's rule (gRPC core's http_proxy_mapper): with a proxy set, a host
    is reached directly if its name ends with an entry of no_grpc_proxy (or
    no_proxy), case aside, or its address lies in an entry's CIDR block.
    Where the two might differ (an unset or empty proxy before a set one, an
    upper-case name) we stand aside: grpcio then makes the call its own way.
    """
    if any(env.get(name) for name in OTHER_PROXY_ENV):
        return False
    if not any(env.get(name) for name in PROXY_ENV):
        return True
    bypass = next((env[name] for name in NO_PROXY_ENV if name in env), "")
    host = target.rpartition(":")[0].strip("[]").lower()
    return any(_bypassed(host, entry.strip().lower()) for entry in bypass.split(","))


def _bypassed(host: str, entry: str) -> bool:
    if not entry:
        return False
    if host.endswith(entry):
        return True
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False)
    except ValueError:  # a name, or an entry that is not a CIDR block
        return False


def grpc_timeout(timeout_s: float) -> str:
    """gRPC's timeout header: milliseconds, or from 10 s whole seconds
    (rounded down: at most a tenth earlier), so that a group's calls each
    step repeat one header block, which the server decodes once (h2.server_connection)."""
    if timeout_s >= 10:
        return f"{int(timeout_s)}S"
    return f"{max(1, int(timeout_s * 1000))}m"


def request_headers(method: str, static: bytes) -> bytes:
    """A call's header block but its deadline (`literal("grpc-timeout", ...)`
    may follow): `static` holds :authority and any metadata, as literals."""
    return (
        b"\x83"  # :method POST (static table)
        + b"\x86"  # :scheme http
        + literal(":path", method)
        + static
        + literal("content-type", "application/grpc")
        + literal("te", "trailers")
    )


class LeanChannel:
    """Calls to the gRPC server at `target` (host:port, plain text), on the
    running loop; one connection, opened on first use and again after it is
    lost, by one attempt at a time (a heartbeat and a Quorum call may both
    find none)."""

    def __init__(
        self,
        target: str,
        metadata: tuple[tuple[str, str], ...] = (),
        connection: type[GrpcConnection] = GrpcConnection,
    ) -> None:
        """`connection`: the protocol class of its connections (a benchmark's
        counting subclass)."""
        host, _, port = target.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._static = literal(":authority", target) + b"".join(literal(k, v) for k, v in metadata)
        self._conn: GrpcConnection | None = None
        self._old: list[GrpcConnection] = []
        """Connections replaced while open (a GOAWAY): each closes itself once
        its last call ends (ClientConnection._drained), or with the channel;
        so only those still carrying a call are kept."""
        self._connecting: asyncio.Task[GrpcConnection] | None = None
        self._closed = False
        self._retry_at = 0.0
        self._prefixes: dict[str, bytes] = {}
        """Each method's header fields but the deadline, encoded once."""
        self._connection_class = connection

    @property
    def connected(self) -> bool:
        """Whether it holds an open connection (the next call opens one if not)."""
        conn = self._conn
        return conn is not None and conn.transport is not None and not conn.closing

    async def unary(self, method: str, request: bytes, timeout_s: float) -> bytes:
        """The answer's bytes to `request` of `method` (/package.Service/Method).

        Raises:
            Unavailable: not made or not finished here; make it another way.
            CallFailed: the server's status; DEADLINE_EXCEEDED after `timeout_s`.
        """
        conn = await self._connection(timeout_s)
        deadline = literal("grpc-timeout", grpc_timeout(timeout_s))
        stream_id, call = conn.start(self._prefix(method) + deadline, request)
        # A timer on the future, not wait_for: the answer wakes the caller in one turn.
        late = CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:.1f} s")
        timer = asyncio.get_running_loop().call_later(timeout_s, call.fail, late)
        try:
            return await call.done
        except BaseException:
            conn.cancel(stream_id)  # late or cancelled: the server may stop too
            raise
        finally:
            timer.cancel()

    async def stream(
        self, method: str, on_message: Callable[[bytes], None], connect_s: float = CONNECT_S
    ) -> LeanStream:
        """Opens a streaming call of `method`, without a deadline; each
        message of the server's goes to `on_message`, which must not raise.

        Raises:
            Unavailable: not opened here; open it another way.
        """
        conn = await self._connection(connect_s)
        stream_id, stream = conn.open_stream(self._prefix(method), on_message)
        return LeanStream(conn, stream_id, stream)

    def _prefix(self, method: str) -> bytes:
        """`method`'s header fields but a deadline, encoded once."""
        prefix = self._prefixes.get(method)
        if prefix is None:
            prefix = self._prefixes[method] = request_headers(method, self._static)
        return prefix

    async def _connection(self, timeout_s: float) -> GrpcConnection:
        """The open connection, or a new one (waiting at most `timeout_s`,
        and CONNECT_S); callers that find none meanwhile share its attempt."""
        conn = self._conn
        if conn is not None and conn.transport is not None and not conn.closing:
            return conn
        if self._closed:
            raise Unavailable("the channel is closed")
        if self._connecting is None or self._connecting.done():
            if time.monotonic() < self._retry_at:
                raise Unavailable("the last connection attempt failed moments ago")
            self._connecting = asyncio.ensure_future(self._connect(min(timeout_s, CONNECT_S)))
            self._connecting.add_done_callback(_retrieved)
        # Shielded: one caller's cancellation must not end the others' attempt.
        return await asyncio.shield(self._connecting)

    async def _connect(self, timeout_s: float) -> GrpcConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(self._connection_class, self._host, self._port), timeout_s
            )
        except (OSError, asyncio.TimeoutError) as e:
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            raise Unavailable(f"cannot connect to {self._host}:{self._port}: {e!r}") from None
        if self._closed:  # closed while connecting: nobody would close this one
            conn.abort("the channel was closed")
            raise Unavailable("the channel is closed")
        old = self._conn
        if old is not None and old.transport is not None:
            self._old.append(old)
        self._old = [c for c in self._old if c.transport is not None]
        self._conn = conn
        return conn

    def close(self) -> None:
        self._closed = True  # an attempt under way closes what it opens (_connect)
        for conn in (self._conn, *self._old):
            if conn is not None and conn.transport is not None:
                conn.transport.close()
        self._conn, self._old = None, []


class LeanStream:
    """A streaming call of ours: `write` sends a message; `ended` completes
    when the call ends (b"" on OK; CallFailed, or Unavailable when it was
    lost or cancelled)."""

    def __init__(self, conn: GrpcConnection, stream_id: int, stream: StreamingCall) -> None:
        self._conn, self._id, self._stream = conn, stream_id, stream
        self.ended = stream.done
        self.ended.add_done_callback(_retrieved)  # read or not, no "never retrieved" log

    def write(self, message: bytes) -> None:
        """Raises Unavailable if the message cannot go now; the stream is then done for."""
        if self.ended.done():
            raise Unavailable("the stream has ended")
        self._conn.send_message(self._id, self._stream, message)

    def cancel(self) -> None:
        """Ends the call (RST_STREAM, unless the server ended it): the server
        sees it cancelled."""
        self._stream.fail(Unavailable("cancelled"))
        self._conn.cancel(self._id)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
