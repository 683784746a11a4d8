"""One call of the lean server as its handler sees it: the subset of
`aio.ServicerContext` the project's servicers use, the seam's answers from
outside the handler (lighthouse.rpc.call: park, answer, fail, write,
deliver), and how an answer and its status go out on the stream."""

from __future__ import annotations

import asyncio
import collections.abc
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from lighthouse.rpc import errors
from lighthouse.rpc.h2 import frames
from lighthouse.rpc.h2.limits import LIMITS, TokenBucket
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.lean.request_stream import RequestStream

OK_HEADERS = b"\x88" + frames.literal("content-type", "application/grpc")
"""`:status: 200` (static table entry 8) and the gRPC content type."""
OK_TRAILERS = frames.literal("grpc-status", "0")


class Abort(Exception):
    """`context.abort`: ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def echo(text: str) -> str:
    """A request's own text as an answer may carry it: never longer than
    `Limits.max_echo`, so an answer cannot amplify what a peer sends."""
    limit = LIMITS.max_echo
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def status_trailers(code: grpc.StatusCode, details: str) -> bytes:
    block = frames.literal("grpc-status", str(code.value[0]))
    if details:
        block += frames.literal(
            "grpc-message", urllib.parse.quote(details, safe=" !#$&'()*+,/:;=?@[]~")
        )
    return block


class ServerCall:
    """One call: its stream, its handler and the `ServicerContext` it is given."""

    __slots__ = (
        "conn",
        "stream_id",
        "handler",
        "method",
        "deadline",
        "metadata",
        "body",
        "requests",
        "task",
        "headers_sent",
        "done",
        "timer",
        "encoding",
        "table",
        "on_end",
        "begun",
        "rate",
    )

    def __init__(
        self,
        conn: Connection,
        stream_id: int,
        handler: Any,
        method: str,
        table: dict[tuple[Connection, int], ServerCall],
    ) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.handler = handler
        self.method = method
        self.deadline: float | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.body = bytearray()
        self.requests: RequestStream | None = None
        self.task: asyncio.Task[None] | None = None
        self.headers_sent = False
        self.done = False
        self.timer: asyncio.TimerHandle | None = None
        self.encoding = "identity"
        self.table = table
        """The server's open calls, which this one leaves when it is answered."""
        self.on_end: Callable[[], None] | None = None
        self.begun = False
        """A unary call's handler has run (on its first message)."""
        self.rate: TokenBucket | None = None
        """A streaming call's messages (Limits.stream_message_rate)."""

    # ---- the ServicerContext subset ---------------------------------------------

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)

    def peer(self) -> str:
        return self.conn.peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    # ---- the seam's answers from outside the handler (lighthouse.rpc.call) ----------

    def park(self, on_end: Callable[[], None]) -> None:
        """Keeps a unary call open after its handler returns, with no task
        and no future: it is answered later by `answer` or `fail`, and
        `on_end` runs if it ends otherwise (cancelled, connection lost).
        The lighthouse parks each Quorum call until its quorum is issued:
        a task per call was a third of a call's cost at a step's burst
        (bench/NOTES.md)."""
        self.on_end = on_end

    def answer(self, response: Any) -> None:
        """Sends a unary call's answer at once: the handler's own return
        value is then dropped."""
        if self.done or self.handler.response_streaming:
            return
        self.done = True
        self.table.pop((self.conn, self.stream_id), None)
        if self.timer is not None:
            self.timer.cancel()
        self.send_message(response, OK_TRAILERS)

    def fail(self, error: Exception) -> None:
        self.table.pop((self.conn, self.stream_id), None)
        self.finish(*errors.status_text(error))

    def write(self, message: Any) -> bool:
        """A streaming answer's message, sent in this turn; False: the call has ended."""
        if self.done or not self.conn.is_open(self.stream_id):
            return False
        self.send_message(message, None)
        return True

    def deliver(self, sink: Callable[[Any], None]) -> asyncio.Future[None]:
        """Each message within the read that brought it, with no task woken
        per message (lighthouse.rpc.lean.request_stream)."""
        if self.requests is None:
            raise TypeError(f"{self.method} does not stream its requests")
        return self.requests.deliver(sink)

    # ---- answers -------------------------------------------------------------------

    def send_message(self, message: Any, trailers: bytes | None) -> None:
        serialize = self.handler.response_serializer
        raw = message if serialize is None else serialize(message)
        headers = None if self.headers_sent else OK_HEADERS
        self.headers_sent = True
        body = b"\x00" + len(raw).to_bytes(4, "big") + raw
        self.conn.send(self.stream_id, headers, body, trailers)

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        trailers = OK_TRAILERS if code is grpc.StatusCode.OK else status_trailers(code, details)
        headers = None if self.headers_sent else OK_HEADERS
        self.conn.send(self.stream_id, headers, b"", trailers)


class ResumedHandler(collections.abc.Coroutine):  # type: ignore[type-arg]
    """The rest of a handler coroutine whose first step ran inline and then
    waited on `first`: run by a task, it resumes where the step stopped. A
    coroutine object of its own, not an `async def` around the handler's: a
    task cancelled before its first step throws into the handler too, so
    the handler's `finally` runs (an `async def` would end before its body)."""

    def __init__(self, coro: Any, first: Any) -> None:
        self._coro = coro
        self._first: Any = first
        self._started = False

    def send(self, value: Any) -> Any:
        if not self._started:
            self._started = True
            return self._first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._started = True
        return (
            self._coro.throw(typ) if val is None and tb is None else self._coro.throw(typ, val, tb)
        )

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        raise TypeError("a task runs this coroutine; it is not awaited")


async def stream_out(responses: Any, call: ServerCall) -> None:
    """A response-streaming handler written as an async generator."""
    async for response in responses:
        if not call.write(response):
            raise grpc.RpcError("the call has ended")
