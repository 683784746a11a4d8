"""The one call shape both server runtimes hand a servicer: the transport seam.

A servicer method gets `(request, call)` from either runtime, where
`request` is the message (or, for a streaming request, an async iterator
of them) and `call` is a `Call`. Our own runtime's call
(lighthouse.rpc.lean.server) is one; grpcio's context is wrapped into one
(lighthouse.rpc.grpcio_server). So no servicer or coordinator asks which
runtime it runs on.

A method answers by returning its response, or later: it `park`s the call
and returns None, and whoever holds the call then `answer`s or `fail`s it,
on the server's loop, in any turn. A response-streaming method `write`s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import grpc


class Call(Protocol):
    """One call, as a servicer and the lighthouse's coordinator see it."""

    def time_remaining(self) -> float | None:
        """Seconds to the caller's deadline; None: it set none."""
        ...

    def peer(self) -> str: ...

    def invocation_metadata(self) -> Any: ...

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """Ends the call with this status, from inside its handler (raises)."""
        ...

    def park(self, on_end: Callable[[], None]) -> None:
        """Keeps the call open after its handler returns None: it is answered
        by `answer` or `fail`, and `on_end` runs if it ends otherwise (the
        caller cancelled, its connection was lost). The parker keeps the
        deadline."""
        ...

    def answer(self, response: Any) -> None:
        """Sends a unary call's answer (a message, or its bytes); nothing once ended."""
        ...

    def fail(self, error: Exception) -> None:
        """Ends the call with `error`'s status (lighthouse.rpc.errors); nothing once ended."""
        ...

    def write(self, message: Any) -> bool:
        """Sends one message of a streaming answer; False: the call has ended."""
        ...

    def deliver(self, sink: Callable[[Any], None]) -> Awaitable[None]:
        """Hands each message of a streaming request to `sink`, in order.
        The awaitable ends with the stream: None, or what `sink` raised
        (nothing more is delivered after that)."""
        ...
