"""Counts the gRPC calls a benchmark process makes, by method, from the client side.

`install()` wraps grpc's channel constructors (blocking and asyncio) with a
counting interceptor before any client is built, and our lean client's
calls, so the library itself needs no hook. `CountingProxy` counts the
calls into a client object we cannot intercept (torchft's Rust
ManagerClient: each of its methods is one RPC).
Heartbeats run on a timer beside the step, so `critical_per_step` leaves them
out.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import grpc
from grpc import aio

COUNTS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()
BACKGROUND = {"Heartbeat"}
"""Methods that are sent on a timer, not by the training step."""


def _count(method: str | bytes) -> None:
    name = method.decode() if isinstance(method, bytes) else method
    with _LOCK:
        COUNTS[name.rsplit("/", 1)[-1]] += 1


class _SyncCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        _count(client_call_details.method)
        return continuation(client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        _count(client_call_details.method)
        return continuation(client_call_details, request)


class _AioCounter(aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        _count(client_call_details.method)
        return await continuation(client_call_details, request)


def install() -> None:
    """Counts every later RPC of this process made through grpc's channels."""
    sync_channel, aio_channel = grpc.insecure_channel, aio.insecure_channel

    def counted_sync(*args: Any, **kwargs: Any) -> grpc.Channel:
        return grpc.intercept_channel(sync_channel(*args, **kwargs), _SyncCounter())

    def counted_aio(*args: Any, interceptors: Any = None, **kwargs: Any) -> aio.Channel:
        return aio_channel(*args, interceptors=[*(interceptors or []), _AioCounter()], **kwargs)

    grpc.insecure_channel = counted_sync
    aio.insecure_channel = counted_aio

    from lighthouse.rpc.lean.client import LeanChannel

    lean_unary = LeanChannel.unary

    async def counted_lean(self: LeanChannel, method: str, *args: Any) -> bytes:
        _count(method)
        return await lean_unary(self, method, *args)

    LeanChannel.unary = counted_lean  # type: ignore[method-assign]


class CountingProxy:
    """Forwards to `target`, counting calls of the named methods as RPCs."""

    def __init__(self, target: Any, rpc_methods: dict[str, str]) -> None:
        self._target = target
        self._rpc_methods = rpc_methods

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        rpc = self._rpc_methods.get(name)
        if rpc is None:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            _count(rpc)
            return attr(*args, **kwargs)

        return counted


def snapshot() -> dict[str, int]:
    with _LOCK:
        return dict(COUNTS)


def critical_per_step(before: dict[str, int], after: dict[str, int], steps: int) -> float:
    """RPCs per step sent by the step itself (heartbeats left out)."""
    calls = sum(n - before.get(m, 0) for m, n in after.items() if m not in BACKGROUND)
    return calls / steps if steps else 0.0
