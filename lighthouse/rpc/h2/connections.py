"""A server's open HTTP/2 connections: how many it keeps, and for how long idle.

Idle connections (no stream open; a peer that sent the preface and nothing
more is one) cost a file descriptor each. Without a cap, enough of them
exhaust the descriptors, and then a restarted group cannot connect. At the
cap the longest idle connection makes room for the new one, so peers that
hold a call open (every group holds its heartbeat stream) are never the
ones dropped; with none idle, the new connection is refused.
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

from lighthouse.rpc.h2.limits import LIMITS, Limits
from lighthouse.rpc.h2.server_connection import Connection

_RESERVED_FDS = 64
"""Descriptors kept for everything else the process opens (files, its own clients)."""


def connection_cap(limits: Limits = LIMITS) -> int:
    """`limits.max_connections`, or fewer where the descriptor limit is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft - _RESERVED_FDS))


class _Refused(asyncio.Protocol):
    """A connection past the cap with none idle to make room: closed at once."""

    def connection_made(self, transport: Any) -> None:
        transport.abort()


class Connections:
    """The open connections of one server, as the cap and the idle timeout allow."""

    def __init__(self, limits: Limits = LIMITS) -> None:
        self.open: set[Connection] = set()
        self.cap = connection_cap(limits)
        self._idle_s = limits.idle_s

    def admit(self, conn: Connection) -> asyncio.Protocol:
        """`conn`, now counted; past the cap, first the longest idle one is
        closed; a refusal if none is idle."""
        if len(self.open) >= self.cap:
            idle = [c for c in self.open if c.idle_since is not None]
            if not idle:
                return _Refused()
            oldest = min(idle, key=lambda c: c.idle_since or 0.0)
            self.open.discard(oldest)
            oldest.close()
        self.open.add(conn)
        return conn

    def lost(self, conn: Connection) -> None:
        self.open.discard(conn)

    def sweep(self, now: float | None = None) -> int:
        """Closes the connections idle past the timeout; returns how many."""
        deadline = (time.monotonic() if now is None else now) - self._idle_s
        stale = [c for c in self.open if c.idle_since is not None and c.idle_since < deadline]
        for conn in stale:
            self.open.discard(conn)
            conn.close()
        return len(stale)
