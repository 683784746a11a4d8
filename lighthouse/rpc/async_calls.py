"""asyncio calls to one gRPC server over one channel with its fallback: the
twin of channel.BlockingCalls for clients that live on an event loop.

Each call goes over our own client (lighthouse.rpc.lean.client, a fraction
of grpcio's wake-ups per call) where grpcio would connect directly (plain
text, no proxy for the host: lean.client.usable), and over grpcio's channel
where ours cannot (TLS, a proxy) or cannot now (no connection). The caller
sees one call shape, bytes in and out, and one error family
(lighthouse.rpc.errors), whichever way a call went.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from lighthouse.rpc import auth
from lighthouse.rpc.channel import aio_channel, tls_refusal, unreachable
from lighthouse.rpc.errors import error_of
from lighthouse.rpc.lean import client as lean_client
from lighthouse.rpc.lean.client import CallFailed, Unavailable
from lighthouse.rpc.tls import TLSConfig

Status = tuple[grpc.StatusCode, str]
MIN_TIMEOUT_S = 0.001


class AsyncCalls:
    """Calls to the server at `target` (`host:port`), each carrying the
    secret and naming `job` (a lighthouse's); TLS with `tls`. `peer` names
    the server in errors, e.g. "lighthouse http://h:29510"; `connect_timeout` bounds the wait for
    grpcio's connection (ours is bounded by lean.client.CONNECT_S)."""

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
        self._target = target
        self._connect_timeout = connect_timeout
        self._tls = tls
        self.grpcio = aio_channel(target, secret, tls, job)
        self.lean = (
            None
            if tls is not None or not lean_client.usable(target)
            else lean_client.LeanChannel(target, auth.metadata(secret, job))
        )
        """Our own channel; None where grpcio's must carry every call."""

    async def unary(
        self,
        method: str,
        request: bytes,
        deadline: float,
        what: str,
        tolerated: tuple[grpc.StatusCode, ...] = (),
    ) -> bytes | None:
        """The answer's bytes to `request` of `method` (/package.Service/Method)
        by `deadline` (monotonic seconds); None for a `tolerated` status.

        Raises:
            LighthouseUnavailableError, QuorumError, ValueError, ...: the
                call failed (lighthouse.rpc.errors.error_of names `what`).
        """
        if self.lean is not None:
            try:
                return await self.lean.unary(method, request, _left(deadline))
            except CallFailed as e:
                return self._failed((e.code, e.details), what, tolerated)
            except Unavailable:
                pass  # grpcio's channel waits for the server, or says why not
        await self.ready(deadline)
        try:
            call: Any = self.grpcio.unary_unary(method)  # bytes in, bytes out
            answer: bytes = await call(request, timeout=_left(deadline))
            return answer
        except grpc.RpcError as e:
            return self._failed(_status_of(e), what, tolerated)

    async def stream(
        self, method: str, on_message: Callable[[bytes], None], timeout_s: float
    ) -> Stream:
        """Opens a streaming call of `method`, without a deadline; each message
        of the server's goes to `on_message`, which must not raise.

        Raises:
            LighthouseUnavailableError: grpcio's connection not ready in time.
        """
        if self.lean is not None:
            try:
                return _LeanStream(await self.lean.stream(method, on_message, timeout_s))
            except Unavailable:
                pass
        await self.ready(time.monotonic() + timeout_s)
        return _GrpcioStream(self.grpcio.stream_stream(method)(), on_message)

    async def ready(self, deadline: float) -> None:
        """Waits for grpcio's connection, at most the connect timeout or to `deadline`."""
        if self.grpcio.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        bound_s = min(self._connect_timeout.total_seconds(), _left(deadline))
        if self._tls is not None:  # a failed handshake would look like a wait until the bound
            refused = await asyncio.to_thread(
                tls_refusal, self._target, self.peer, self._tls, bound_s
            )
            if refused is not None:
                raise refused
        try:
            await asyncio.wait_for(self.grpcio.channel_ready(), bound_s)
        except asyncio.TimeoutError:
            raise unreachable(self.peer, timedelta(seconds=bound_s)) from None

    def error(self, status: Status, what: str) -> Exception:
        """Our exception for a call of `what` that ended with `status`."""
        code, details = status
        return error_of(code, f"{what} at {self.peer} failed: {details}")

    def _failed(
        self, status: Status, what: str, tolerated: tuple[grpc.StatusCode, ...]
    ) -> bytes | None:
        if status[0] in tolerated:
            return None
        raise self.error(status, what)

    async def close(self) -> None:
        if self.lean is not None:
            self.lean.close()
        await self.grpcio.close()


class Stream:
    """A streaming call, whichever channel carries it."""

    def open(self) -> bool:
        raise NotImplementedError

    async def write(self, message: bytes, timeout_s: float) -> bool:
        """Sends one message; False: the call has ended (`status` says how)."""
        raise NotImplementedError

    async def status(self) -> Status:
        """How an ended call ended."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Ends the call: the server sees it cancelled."""
        raise NotImplementedError


class _LeanStream(Stream):
    def __init__(self, stream: lean_client.LeanStream) -> None:
        self._stream = stream

    def open(self) -> bool:
        return not self._stream.ended.done()

    async def write(self, message: bytes, timeout_s: float) -> bool:
        if not self.open():
            return False
        try:
            self._stream.write(message)  # queued on the connection: no wait
        except Unavailable:
            return False
        return True

    async def status(self) -> Status:
        error = self._stream.ended.exception()
        if isinstance(error, CallFailed):
            return error.code, error.details
        if error is not None:
            return grpc.StatusCode.UNAVAILABLE, str(error)
        return grpc.StatusCode.OK, ""

    def cancel(self) -> None:
        self._stream.cancel()


class _GrpcioStream(Stream):
    def __init__(self, call: Any, on_message: Callable[[bytes], None]) -> None:
        self._call = call
        self._ended: Status | None = None
        """How it ended, where grpcio's call cannot say (a write that timed out)."""
        self._reader = asyncio.get_running_loop().create_task(self._read(on_message))

    def open(self) -> bool:
        return self._ended is None and not self._call.done()

    async def write(self, message: bytes, timeout_s: float) -> bool:
        if not self.open():
            return False
        try:
            await asyncio.wait_for(self._call.write(message), timeout_s)
            return True
        except (grpc.RpcError, asyncio.InvalidStateError):
            return False  # finished meanwhile: its status says why
        except asyncio.TimeoutError:
            self._ended = (grpc.StatusCode.DEADLINE_EXCEEDED, f"not sent within {timeout_s:.1f} s")
            self.cancel()
            return False

    async def status(self) -> Status:
        if self._ended is not None:
            return self._ended
        return await self._call.code(), await self._call.details()

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.cancel()

    async def _read(self, on_message: Callable[[bytes], None]) -> None:
        """Hands each answer on; the call's end (an error included) is the writer's to report."""
        try:
            async for message in self._call:
                on_message(message)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass


def _status_of(e: grpc.RpcError) -> Status:
    return e.code(), e.details() or ""


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), MIN_TIMEOUT_S)
