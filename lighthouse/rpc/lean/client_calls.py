"""Our client's gRPC calls over our HTTP/2 connection (lighthouse.rpc.h2):
each message with its 5-byte prefix, and a call's end as its status.

A message over MAX_MESSAGE_BYTES fails its call with RESOURCE_EXHAUSTED, as
grpcio's would; a status other than OK is `CallFailed`; a call that could
not be made or finished on the connection is h2's `Unavailable`.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from urllib.parse import unquote

import grpc

from lighthouse.rpc.h2.client_connection import MAX_HELD, ClientConnection, ClientStream
from lighthouse.rpc.h2.client_connection import Unavailable as Unavailable

_MESSAGE = struct.Struct(">BI")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
MAX_MESSAGE_BYTES = MAX_HELD - 5
"""The largest message of an answer: grpcio's default receive limit; past it
the call fails with RESOURCE_EXHAUSTED, as grpcio's would."""


class CallFailed(Exception):
    """The server ended the call with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def framed(message: bytes) -> bytes:
    """`message` as a gRPC request's body carries it (uncompressed)."""
    return _MESSAGE.pack(0, len(message)) + message


class UnaryCall(ClientStream):
    """A call with one answer: `done` gets its message's bytes, or the error."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.done: asyncio.Future[bytes] = loop.create_future()

    def fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def take(self, payload: bytes) -> bool:
        """Bytes of the answer, held until it ends. False: the call failed
        (an answer over MAX_MESSAGE_BYTES), and its stream is to be reset.
        A message declared larger fails here once that many bytes came, or
        in `finish`: the common path reads no prefix but once."""
        body = self.body
        body += payload
        if len(body) > MAX_HELD:
            declared: int = _MESSAGE.unpack_from(body)[1]
            return self.too_large(max(declared, len(body) - 5))
        return True

    def too_large(self, size: int) -> bool:
        self.fail(
            CallFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})",
            )
        )
        return False

    def ending(self, trailers: list[tuple[str, str]]) -> Exception | None:
        """What the end of the call says went wrong, if anything."""
        fields = dict(self.headers)
        fields.update(trailers)
        if fields.get(":status", "200") != "200":
            return Unavailable(f"HTTP status {fields[':status']}")
        try:
            number = int(fields.get("grpc-status", "2"))
        except ValueError:
            number = -1
        code = _CODES.get(number, grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            return CallFailed(code, unquote(fields.get("grpc-message", "")))
        return None

    def finish(self, trailers: list[tuple[str, str]]) -> None:
        error = self.ending(trailers)
        if error is not None:
            self.fail(error)
            return
        body = bytes(self.body)
        if len(body) < 5:
            self.fail(CallFailed(grpc.StatusCode.INTERNAL, "an answer without a message"))
            return
        compressed, size = _MESSAGE.unpack_from(body)
        if size > MAX_MESSAGE_BYTES:  # an answer cut short by the server
            self.too_large(size)
            return
        if compressed or size != len(body) - 5:  # we accept no encoding: none is sent
            self.fail(Unavailable("a compressed or malformed answer"))
            return
        if not self.done.done():
            self.done.set_result(body[5:])


class StreamingCall(UnaryCall):
    """A streaming call: each message that arrives goes to `on_message`
    (which must not raise); `done` is b"" once the server ends it with OK."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_message: Callable[[bytes], None]
    ) -> None:
        super().__init__(loop)
        self.on_message = on_message

    def take(self, payload: bytes) -> bool:
        """Hands each whole message on as it arrives. False: the call failed
        (a message over MAX_MESSAGE_BYTES, or compressed), and its stream is
        to be reset."""
        if self.done.done():  # failed on our side: nobody reads on
            return True
        body = self.body
        body += payload
        while len(body) >= 5:
            compressed, size = _MESSAGE.unpack_from(body)
            if size > MAX_MESSAGE_BYTES:
                return self.too_large(size)
            if compressed:  # we accept no encoding: none is sent
                self.fail(Unavailable("a compressed message"))
                return False
            if len(body) < 5 + size:
                return True
            message = bytes(body[5 : 5 + size])
            del body[: 5 + size]
            self.on_message(message)
        return True

    def finish(self, trailers: list[tuple[str, str]]) -> None:
        error = self.ending(trailers)
        if error is not None:
            self.fail(error)
        elif not self.done.done():
            self.done.set_result(b"")


class GrpcConnection(ClientConnection):
    """A client connection whose streams are gRPC calls."""

    def start(self, headers: bytes, message: bytes) -> tuple[int, UnaryCall]:
        """Sends one unary call; raises Unavailable if it cannot."""
        call = UnaryCall(asyncio.get_running_loop())
        return self.request(headers, framed(message), call), call

    def open_stream(
        self, headers: bytes, on_message: Callable[[bytes], None]
    ) -> tuple[int, StreamingCall]:
        """Opens a streaming call (its headers only); raises Unavailable if it cannot."""
        stream = StreamingCall(asyncio.get_running_loop(), on_message)
        return self.open(headers, stream), stream

    def send_message(self, stream_id: int, stream: StreamingCall, message: bytes) -> None:
        """One message on an open streaming call; raises Unavailable if it cannot go now."""
        self.send(stream_id, stream, framed(message))
