"""Answers requests whose bytes do not decode as the method's message with
INVALID_ARGUMENT, for every gRPC server of the project.

Without it grpc's asyncio server logs a traceback and answers UNKNOWN
("Unexpected DecodeError"), which reads as a server bug, not as bad input.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio


class _Undecodable:
    """Stands in for the request that could not be decoded."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class RejectUndecodable(aio.ServerInterceptor):  # type: ignore[misc]
    """Wraps each unary-request method so that a DecodeError becomes a
    refusal naming the method and the parser's reason. Handlers of
    streaming requests are passed through unchanged."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        wrapped = _wrap(method, handler)
        self._wrapped[method] = wrapped
        return wrapped


def _wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def safe_decode(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError as e:
            return _Undecodable(e)

    async def refuse(request: Any, context: aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: the request bytes are not a valid message of this method "
            f"({request.error}); check that client and server use the same proto",
        )

    if handler.response_streaming:
        inner_stream = handler.unary_stream
        # grpc picks how to run a handler from its kind: keep the kind.
        if inspect.isasyncgenfunction(inner_stream):

            async def stream(request: Any, context: aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                async for response in inner_stream(request, context):
                    yield response

        elif inspect.iscoroutinefunction(inner_stream):

            async def stream(request: Any, context: aio.ServicerContext) -> Any:  # type: ignore[misc]
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                return await inner_stream(request, context)

        else:
            return handler
        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=safe_decode,
            response_serializer=handler.response_serializer,
        )

    inner = handler.unary_unary
    if not inspect.iscoroutinefunction(inner):
        return handler

    async def unary(request: Any, context: aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=safe_decode, response_serializer=handler.response_serializer
    )
