"""A gRPC server on asyncio alone (over lighthouse.rpc.h2), for the lighthouse's hot path.

It serves the method tables grpcio's generated code registers (the same
handlers, serializers and decode guard) with the subset of
`aio.ServicerContext` the project's servicers use. Same wire, same
statuses; what differs is the cost: one `data_received` and one `write`
per unary call on the loop's own thread, and a handler that finishes
without waiting runs inline, with no task. `serve.new_server` picks it or
grpcio's server (`rpc_server`).

Compressed requests (gzip, deflate) are read, within the message limit;
answers go uncompressed, as gRPC allows. Left out, as our servicers need
none: server-side interceptors other than the shared secret.

Bounded as lighthouse.rpc.h2.limits says: connections (past the cap the
longest idle one makes room), their idle time, and what an answer echoes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import ssl
import time
import zlib
from collections.abc import Callable
from typing import Any

import grpc

from lighthouse.rpc import auth
from lighthouse.rpc.h2.connections import Connections
from lighthouse.rpc.h2.limits import TokenBucket
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.h2.shares import ProcessBudget
from lighthouse.rpc.h2.tls_accept import TlsAccept
from lighthouse.rpc.lean.request_stream import RequestStream
from lighthouse.rpc.lean.server_call import (
    OK_HEADERS,
    OK_TRAILERS,
    Abort,
    ResumedHandler,
    ServerCall,
    echo,
    status_trailers,
    stream_out,
)
from lighthouse.rpc.tls import TLSConfig

logger = logging.getLogger(__name__)

_UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_RESERVED = frozenset(
    ("content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "user-agent")
)
_WBITS = {"gzip": 31, "deflate": 15}
"""grpc-encoding -> zlib's wbits for it."""
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""grpcio's default limit on a received message, compressed or not."""
_SWEEP_S = 5.0
"""How often connections are looked at (Connections.sweep)."""
DECOMPRESSED_BYTES_PER_UNIT = 1024
"""A decompressed message is charged one work unit per KiB it inflates to."""
MESSAGE_WORK = 5
"""Work units of one streamed request message: a heartbeat on a stream costs
the lighthouse about 10 us (bench.lighthouse_scale --attack stream_flood)."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues for accept: a job's groups reconnecting at once."""
ACCEPT_BATCH = 16
"""Connections accepted per turn of the loop (asyncio accepts `backlog` at
once): 1,000 connects at once would otherwise be set up in one turn, tens
of milliseconds that every call waiting on the loop waits out."""


class LeanServer:
    """A gRPC server for handler tables registered the way grpcio's
    generated `add_*_to_server` does; the API of `aio.Server` that
    lighthouse.rpc.serve uses."""

    def __init__(
        self,
        secret: str | auth.Secrets | None = None,
        service: str = "server",
        stream_message_rate: tuple[float, float] | None = None,
    ) -> None:
        """`stream_message_rate`: request messages one streaming call may send
        (a burst, then so many a second; Limits.stream_message_rate), None: no rate."""
        self._stream_rate = stream_message_rate
        burst, rate = stream_message_rate or (0.0, 0.0)
        self._past_rate = f"more than {burst:.0f} messages, then {rate:.0f} a second, on one stream"
        self._secrets = auth.Secrets.of(secret)
        if self._secrets is not None:
            self._secrets.validate(service)
        self._service = service
        self._refusals = auth.RefusalLog()
        self._handlers: dict[str, Any] = {}
        self._calls: dict[tuple[Connection, int], ServerCall] = {}
        self._conns = Connections()
        self._budget = ProcessBudget()
        self._sweeper: asyncio.TimerHandle | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._sockets: list[tuple[socket.socket, ssl.SSLContext | None]] = []

    # ---- registration (what generated code and decode_guard call) ----------------

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same methods come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self._handlers[f"/{service}/{name}"] = handler

    # ---- ports and lifetime ---------------------------------------------------------

    def add_port(self, address: str, tls: TLSConfig | None) -> int:
        """Binds `address`, with TLS (HTTP/2 by ALPN) when `tls` is set;
        returns the port, 0 if none bound."""
        context = None
        if tls is not None:
            context = tls.server_context()
            context.set_alpn_protocols(["h2"])
        return self._bind(address, context)

    def _bind(self, address: str, context: ssl.SSLContext | None) -> int:
        """Binds now (so the port is known and a taken one fails here); the
        sockets listen from `start`. Returns the port, 0 if none bound."""
        host, _, port_text = address.rpartition(":")
        host = host.strip("[]")
        port = int(port_text)
        bound = 0
        for family, _, _, _, sockaddr in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and sockaddr[0] == "::":
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((sockaddr[0], bound or port, *sockaddr[2:]))
            except OSError:
                sock.close()
                continue
            bound = sock.getsockname()[1]
            self._sockets.append((sock, context))
        return bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock, context in self._sockets:
            factory: Callable[[], asyncio.Protocol] = self._connection
            if context is not None:
                factory = TlsAccept(self._connection, context, self._handshakes)
            server = await loop.create_server(factory, sock=sock, backlog=ACCEPT_BATCH)
            sock.listen(LISTEN_BACKLOG)  # the kernel's queue; asyncio's batch stays
            self._servers.append(server)
        self._sweeper = loop.call_later(_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        self._conns.sweep()
        self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def _connection(self) -> Connection:
        return Connection(self, self._conns, budget=self._budget)

    def calmed(self) -> dict[str, int]:
        """Connections closed with ENHANCE_YOUR_CALM for a flood, by kind
        (a copy: the metrics read it from their own thread)."""
        return dict(self._budget.calmed)

    async def stop(self, grace: float | None) -> None:
        """Stops listening; open calls get `grace` seconds (None: none), then are cancelled."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            server.close()
        for handshake in list(self._handshakes):
            handshake.cancel()
        for conn in list(self._conns.open):
            conn.goaway()
        calls, self._calls = list(self._calls.values()), {}
        tasks = [call.task for call in calls if call.task is not None and not call.task.done()]
        if grace and tasks:  # handlers that never wait are done already
            await asyncio.wait(tasks, timeout=grace)
        for call in calls:
            call.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        for task in tasks:
            task.cancel()
        if tasks:  # their `finally` blocks run before the loop may stop
            await asyncio.wait(tasks, timeout=5)
        for conn in list(self._conns.open):
            conn.close()
        for server in self._servers:
            await server.wait_closed()

    # ---- calls (lighthouse.rpc.h2.server_connection.StreamHandler) -------------------------------

    def on_headers(self, conn: Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        path = method = content_type = ""
        timeout: str | None = None
        presented: str | None = None
        job: str | None = None
        encoding = "identity"
        metadata = []
        for name, value in headers:
            if name[0] == ":":
                if name == ":path":
                    path = value
                elif name == ":method":
                    method = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = value
            elif name == "grpc-encoding" and value != "identity":
                if value not in _WBITS:
                    named = echo(value)
                    unsupported = f"compression {named!r} is not supported (gzip, deflate are)"
                    trailers = status_trailers(_UNIMPLEMENTED, unsupported)
                    conn.refuse_call(stream_id, OK_HEADERS, trailers)
                    return
                encoding = value
            elif name not in _RESERVED:
                metadata.append((name, value))
                if name == auth.METADATA_KEY:
                    presented = value
                elif name == auth.JOB_METADATA_KEY:
                    job = value
        if method != "POST" or not content_type.startswith("application/grpc"):
            conn.refuse_call(stream_id, OK_HEADERS, None)  # not a gRPC request: reset
            return
        handler = self._handlers.get(path)
        if handler is None:
            unknown = status_trailers(_UNIMPLEMENTED, f"Method not found: {echo(path)}")
            conn.refuse_call(stream_id, OK_HEADERS, unknown)
            return
        if self._secrets is not None:
            why = self._secrets.refusal(presented, job, self._service)
            if why is not None:
                self._refusals.refused(conn.peer.rsplit(":", 1)[0], path, why)
                trailers = status_trailers(grpc.StatusCode.UNAUTHENTICATED, why)
                conn.refuse_call(stream_id, OK_HEADERS, trailers)
                return
        call = ServerCall(conn, stream_id, handler, path, self._calls)
        call.metadata = tuple(metadata)
        call.encoding = encoding
        if timeout is not None and 2 <= len(timeout) <= 9:  # gRPC: at most 8 digits
            try:
                call.deadline = time.monotonic() + int(timeout[:-1]) * _TIMEOUT_UNITS[timeout[-1]]
            except (KeyError, ValueError):
                pass
        self._calls[conn, stream_id] = call
        if handler.request_streaming:
            call.requests = RequestStream(handler.request_deserializer, conn, stream_id)
            if self._stream_rate is not None:
                call.rate = TokenBucket(self._stream_rate)
            self._run(call, call.requests)

    def on_data(self, conn: Connection, stream_id: int, data: bytes, end: bool) -> None:
        call = self._calls.get((conn, stream_id))
        if call is None:
            conn.consumed(stream_id, len(data))
            return
        body = call.body
        body += data
        while len(body) >= 5:
            size = int.from_bytes(body[1:5], "big")
            if size > MAX_MESSAGE_BYTES:
                why = f"received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})"
                self._end(call, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                return
            if len(body) < 5 + size:
                if not conn.grant(stream_id, 5 + size):
                    why = f"the server holds too many large requests to take one of {size} bytes"
                    self._end(call, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                    return
                break
            message = bytes(body[5 : 5 + size])
            compressed = body[0]
            del body[: 5 + size]
            if compressed:
                message, code, why = decompressed(message, call.encoding)
                conn.charge(len(message) // DECOMPRESSED_BYTES_PER_UNIT)
                if why:
                    self._end(call, code, why)
                    return
            if call.requests is not None:
                if call.rate is not None and not call.rate.take():
                    self._end(call, grpc.StatusCode.RESOURCE_EXHAUSTED, self._past_rate)
                    if call.task is not None:  # its handler hears no more
                        call.task.cancel()
                    conn.refused()
                    return
                conn.charge(MESSAGE_WORK)
                call.requests.push(message, 5 + size)
                continue
            conn.consumed(stream_id, 5 + size)
            if not call.begun and not call.done:
                call.begun = True  # a unary call runs on its first message
                call.body = bytearray()
                self._run_unary(call, message)
                return
        if end:
            if call.requests is not None:
                call.requests.push(None)
            elif not call.begun and not call.done:
                self._end(call, grpc.StatusCode.INTERNAL, "the request carried no message")

    def on_closed(self, conn: Connection, stream_id: int) -> None:
        call = self._calls.pop((conn, stream_id), None)
        if call is not None:
            call.done = True
            if call.timer is not None:
                call.timer.cancel()
            if call.task is not None:
                call.task.cancel()
            if call.on_end is not None:
                call.on_end()

    # ---- running handlers ---------------------------------------------------------------

    def _run_unary(self, call: ServerCall, raw: bytes) -> None:
        handler = call.handler
        decode = handler.request_deserializer
        try:
            request = decode(raw) if decode is not None else raw
        except Exception as e:
            self._end(call, grpc.StatusCode.INTERNAL, f"cannot decode the request: {e}")
            return
        self._run(call, request)

    def _run(self, call: ServerCall, request: Any) -> None:
        """Runs the handler's first step inline; a handler that waits goes on in a task."""
        handler = call.handler
        if handler.request_streaming:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        try:
            result = behavior(request, call)
            if inspect.isasyncgen(result):
                result = stream_out(result, call)
            elif not inspect.iscoroutine(result):
                self._answer(call, result)
                return
            first = result.send(None)
        except StopIteration as stop:
            self._answer(call, stop.value)
            return
        except BaseException as e:
            self._failed(call, e)
            return
        call.task = asyncio.get_running_loop().create_task(ResumedHandler(result, first))
        call.task.add_done_callback(lambda task: self._settle(call, task))
        if call.deadline is not None:
            call.timer = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + (call.time_remaining() or 0.0),
                self._overdue,
                call,
            )

    def _settle(self, call: ServerCall, task: asyncio.Task[Any]) -> None:
        """A handler that waited has ended: answers with its result or error."""
        if task.cancelled():
            self._failed(call, asyncio.CancelledError())
        elif task.exception() is not None:
            self._failed(call, task.exception())  # type: ignore[arg-type]
        else:
            self._answer(call, task.result())

    def _answer(self, call: ServerCall, result: Any) -> None:
        if call.on_end is not None and not call.done:
            return  # parked: answered later
        self._calls.pop((call.conn, call.stream_id), None)
        if call.done:
            return  # answered by `answer`, or ended
        if call.handler.response_streaming:
            call.finish(grpc.StatusCode.OK)
            return
        if result is None:
            call.finish(grpc.StatusCode.INTERNAL, f"{call.method} returned no response")
            return
        call.done = True
        if call.timer is not None:
            call.timer.cancel()
        call.send_message(result, OK_TRAILERS)

    def _failed(self, call: ServerCall, e: BaseException) -> None:
        if isinstance(e, Abort):
            self._end(call, e.code, e.details)
        elif isinstance(e, asyncio.CancelledError):
            self._end(call, grpc.StatusCode.CANCELLED, "the call was cancelled")
        else:
            logger.error("%s failed", call.method, exc_info=e)
            self._end(call, grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")

    def _end(self, call: ServerCall, code: grpc.StatusCode, details: str) -> None:
        self._calls.pop((call.conn, call.stream_id), None)
        call.finish(code, details)

    def _overdue(self, call: ServerCall) -> None:
        if call.task is not None and not call.done:
            self._end(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            call.task.cancel()


def decompressed(message: bytes, encoding: str) -> tuple[bytes, grpc.StatusCode, str]:
    """`message` decompressed, never past the message limit, or the status
    and text that say what was wrong with it."""
    internal = grpc.StatusCode.INTERNAL
    try:
        inflate = zlib.decompressobj(_WBITS[encoding])
        out = inflate.decompress(message, MAX_MESSAGE_BYTES + 1)
    except (KeyError, zlib.error) as e:
        return b"", internal, f"a compressed message that does not decompress as {encoding}: {e}"
    if len(out) > MAX_MESSAGE_BYTES:
        why = f"received message larger than max (decompressed, over {MAX_MESSAGE_BYTES})"
        return b"", grpc.StatusCode.RESOURCE_EXHAUSTED, why
    if not inflate.eof:
        return b"", internal, f"a compressed message cut short ({encoding})"
    return out, grpc.StatusCode.OK, ""
