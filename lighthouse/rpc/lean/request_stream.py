"""A streaming call's requests, as our server (lean.server) hands them over:
an async iterator (grpcio's shape), or, for a handler that asks, each
message delivered within the read that brought it (`deliver`)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from lighthouse.rpc.h2.server_connection import Connection


class RequestStream:
    """A streaming call's request iterator, fed by the connection. A message
    counts against the peer's window until the handler takes it."""

    def __init__(self, decode: Callable[[bytes], Any] | None, conn: Connection, sid: int) -> None:
        self._decode = decode
        self._conn, self._sid = conn, sid
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[Any], None] | None = None
        self._ended: asyncio.Future[None] | None = None

    def push(self, item: Any, nbytes: int = 0) -> None:
        """A message's bytes (`nbytes` on the wire), or None for the end of the stream."""
        if self._sink is not None:
            self._deliver(item, nbytes)
            return
        self._items.append((item, nbytes))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def deliver(self, sink: Callable[[Any], None]) -> asyncio.Future[None]:
        """From now on each message goes to `sink` within the read that
        brought it, not through the handler's task (a wake per message was
        most of a heartbeat's cost). Returns the future of the stream's end:
        None, or what `sink` or the decoder raised, after which nothing more
        is delivered (lighthouse.rpc.call.Call.deliver)."""
        self._ended = asyncio.get_running_loop().create_future()
        self._sink = sink
        while self._items and self._sink is not None:
            self._deliver(*self._items.popleft())
        return self._ended

    def _deliver(self, item: Any, nbytes: int) -> None:
        ended = self._ended
        assert ended is not None
        if ended.done():
            return
        if item is None:
            self._sink = None
            ended.set_result(None)
            return
        self._conn.consumed(self._sid, nbytes)
        try:
            self._sink(self._decode(item) if self._decode is not None else item)  # type: ignore[misc]
        except Exception as e:
            self._sink = None
            ended.set_exception(e)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item, nbytes = self._items.popleft()
        if item is None:
            self._items.appendleft((None, 0))
            raise StopAsyncIteration
        self._conn.consumed(self._sid, nbytes)
        return self._decode(item) if self._decode is not None else item
