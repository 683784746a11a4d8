"""grpcio's asyncio server behind the transport seam (lighthouse.rpc.call).

The adapter: every handler registered here gets a `GrpcioCall` instead of
grpcio's context, so a servicer written against `Call` runs unchanged on
either runtime. What grpcio lacks, the call makes from grpcio's parts: a
parked call is a future its handler awaits, a streaming answer is a queue
one writer task empties, delivered requests are read by a task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from grpc import aio

from lighthouse.rpc import auth, errors
from lighthouse.rpc.tls import TLSConfig

logger = logging.getLogger(__name__)

SERVER_OPTIONS = [
    # Off: a second server on a port in use must fail, not share it.
    ("grpc.so_reuseport", 0),
    # A connection that has not finished its HTTP/2 handshake in 10 s (a port
    # scan, a stray HTTP/1 client) is dropped, not held for gRPC's default 120 s.
    ("grpc.server_handshake_timeout_ms", 10_000),
    # A connection with no call for 5 minutes is closed; our clients keep a
    # call open (the heartbeat stream) or reconnect on their next call.
    ("grpc.max_connection_idle_ms", 300_000),
]

WRITER_DRAIN_S = 1.0
"""How long a streaming call that is aborted waits for its writes in
flight: grpcio fails an abort while a write is in flight, and then never
ends the call. A peer that does not read its answers keeps it only until
its connection closes."""


class GrpcioServer:
    """`aio.server` in the shape lighthouse.rpc.serve uses (the same as
    lighthouse.rpc.lean.server.LeanServer's): handler tables in, ports,
    start and stop."""

    def __init__(
        self,
        secret: str | auth.Secrets | None,
        service: str,
        stream_message_rate: tuple[float, float] | None = None,
    ) -> None:
        """`stream_message_rate` is not kept: grpcio's server has no such bound."""
        self._server = aio.server(
            options=SERVER_OPTIONS, interceptors=auth.server_interceptors(secret, service)
        )

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same methods come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        adapted = {name: _adapt(handler) for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, adapted),)
        )
        self._server.add_registered_method_handlers(service, adapted)

    def add_port(self, address: str, tls: TLSConfig | None) -> int:
        """Returns the port bound, 0 if none."""
        try:
            if tls is not None:
                return self._server.add_secure_port(address, tls.server_credentials())
            return self._server.add_insecure_port(address)
        except RuntimeError:
            return 0

    async def start(self) -> None:
        await self._server.start()

    async def stop(self, grace: float | None) -> None:
        await self._server.stop(grace)

    def calmed(self) -> dict[str, int]:
        """Connections closed for a flood, by kind: grpcio's server keeps no such count."""
        return {}


class GrpcioCall:
    """grpcio's `ServicerContext` as a `Call` (lighthouse.rpc.call)."""

    def __init__(self, context: aio.ServicerContext[Any, Any], requests: Any = None) -> None:
        self._context = context
        self._requests = requests
        self._outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        """A parked call's answer, or the error it was failed with."""
        self._on_end: Callable[[], None] | None = None
        self._writes: asyncio.Queue[Any] | None = None
        self._writer: asyncio.Task[None] | None = None

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def peer(self) -> str:
        return self._context.peer()

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        if self._writer is not None and self._writes is not None:
            self._writes.put_nowait(None)
            await asyncio.wait([self._writer], timeout=WRITER_DRAIN_S)
        await self._context.abort(code, details)
        raise AssertionError("context.abort returned")  # it raises

    def park(self, on_end: Callable[[], None]) -> None:
        self._on_end = on_end

    def answer(self, response: Any) -> None:
        if not self._outcome.done():
            self._outcome.set_result(response)

    def fail(self, error: Exception) -> None:
        if not self._outcome.done():
            self._outcome.set_exception(error)

    def write(self, message: Any) -> bool:
        if self._outcome.done() or self._context.done():
            return False
        if self._writes is None:
            self._writes = asyncio.Queue()
            self._writer = asyncio.get_running_loop().create_task(self._write_all(self._writes))
        self._writes.put_nowait(message)
        return True

    async def deliver(self, sink: Callable[[Any], None]) -> None:
        async for request in self._requests:
            sink(request)

    async def run(self, handling: Any) -> Any:
        """The handler's answer: what it returned, or, after it parked, what
        the call was answered with. An error it was failed with ends the
        call with that error's status."""
        try:
            response = await handling
            if response is None and (self._on_end is not None or self._outcome.done()):
                try:  # shielded: a cancelled wait leaves the outcome unset
                    response = await asyncio.shield(self._outcome)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    await errors.abort(self, e)
            return response
        finally:
            if self._writer is not None:
                self._writer.cancel()
            if self._on_end is not None and not self._outcome.done():
                self._on_end()  # the caller went away, or the server stops

    async def _write_all(self, writes: asyncio.Queue[Any]) -> None:
        """Writes the streaming answer's messages in order until a None,
        cancelled, or the call fails under it (its reader then ends it)."""
        try:
            while (message := await writes.get()) is not None:
                await self._context.write(message)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # the call ended under us (grpc's UsageError, an RpcError)
            logger.debug("a streaming answer's write failed: %s", e)


def _adapt(handler: Any) -> Any:
    """`handler` with a GrpcioCall in place of grpcio's context; its kind kept."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    behavior = {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }[streaming_in, streaming_out]

    async def run(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        call = GrpcioCall(context, request if streaming_in else None)
        return await call.run(behavior(request, call))

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[streaming_in, streaming_out]
    return make(
        run,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
