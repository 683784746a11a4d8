"""TLS connections of a server, counted from accept.

asyncio's TLS server makes the protocol's connection only once the
handshake is done, and gives a handshake 60 s: a peer that connects and
says nothing holds a socket that long, outside any count (~17 connects a
second exhaust 1,024 descriptors). Here the port listens in plain TCP; each
connection is admitted at accept (the connection cap and its host's share),
then given `Limits.tls_handshake_s` for its handshake (loop.start_tls).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from lighthouse.rpc.h2.limits import LIMITS
from lighthouse.rpc.h2.server_connection import Connection


class TlsAccept:
    """The protocol factory of a TLS port."""

    def __init__(
        self,
        connection: Callable[[], Connection],
        context: ssl.SSLContext,
        handshakes: set[asyncio.Task[None]],
    ) -> None:
        self._connection = connection
        self._context = context
        self.handshakes = handshakes
        """The handshakes under way (the server cancels them as it stops)."""

    def __call__(self) -> asyncio.Protocol:
        return _Handshaking(self)


class _Handshaking(asyncio.Protocol):
    """A TLS connection until its handshake is done; then its Connection takes over."""

    def __init__(self, port: TlsAccept) -> None:
        self._port = port

    def connection_made(self, transport: Any) -> None:
        conn = self._port._connection()
        if not conn.accept(transport):
            transport.abort()
            return
        transport.pause_reading()  # start_tls reads from here on
        task = asyncio.get_running_loop().create_task(self._handshake(transport, conn))
        self._port.handshakes.add(task)
        task.add_done_callback(self._port.handshakes.discard)

    async def _handshake(self, transport: Any, conn: Connection) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport,
                conn,
                self._port._context,
                server_side=True,
                ssl_handshake_timeout=LIMITS.tls_handshake_s,
            )
        except (OSError, asyncio.CancelledError):  # SSLError and TimeoutError are OSErrors
            tls = None
        if tls is None:  # failed, timed out, or the server stops: the count goes now
            transport.abort()
            conn.connection_lost(None)  # (the TLS layer may tell it too: it is idempotent)
            return
        conn.connection_made(tls)
