"""A server's open HTTP/2 connections: how many it keeps, from whom, and for how long.

Every connection costs a file descriptor. Without a cap, enough of them
exhaust the descriptors, and then a restarted group cannot connect. The cap
is shared fairly between hosts (lighthouse.rpc.h2.shares): a host past its
share makes room from its own idle connections, or is refused; at the cap
the host holding the most gives up its longest idle one. Peers that hold a
call open (every group holds its heartbeat stream) are never the ones
dropped, and one host's thousands of connections cannot push out another's.
A connection is counted from accept, TLS handshake included.

The sweep also looks at each connection now and then (Connection.tick):
idle past `idle_s`, answers unread past `write_stall_s`, a keepalive PING
unanswered.
"""

from __future__ import annotations

import resource
import time

from lighthouse.rpc.h2.limits import LIMITS, Limits
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.h2.shares import HostShares

_RESERVED_FDS = 64
"""Descriptors kept for everything else the process opens (files, its own clients)."""


def connection_cap(limits: Limits = LIMITS) -> int:
    """`limits.max_connections`, or fewer where the descriptor limit is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft - _RESERVED_FDS))


class Connections:
    """The open connections of one server, as the cap, its shares and the
    timeouts allow (lighthouse.rpc.h2.server_connection.Admission)."""

    def __init__(self, limits: Limits = LIMITS, cap: int | None = None) -> None:
        self.open: set[Connection] = set()
        self.cap = connection_cap(limits) if cap is None else cap
        self.hosts = HostShares(self.cap)
        self._idle_s = limits.idle_s

    def admit(self, conn: Connection) -> bool:
        """Counts `conn`; past its host's share, or the cap, another idle one
        is closed first: the host's own, else the largest host's. False: none
        could make room."""
        host = conn.host
        over = self.hosts.held(host) + 1 > self.hosts.limit(host)
        if over or len(self.open) >= self.cap:
            victim = self._longest_idle(host if over else self._largest_host())
            if victim is None and not over:
                victim = self._longest_idle(None)
            if victim is None:
                return False
            self._drop(victim)
            victim.evict()
        self.open.add(conn)
        self.hosts.add(host, 1)
        return True

    def _largest_host(self) -> str:
        return max(self.hosts.by_host.items(), key=lambda item: item[1])[0]

    def _longest_idle(self, host: str | None) -> Connection | None:
        idle = [
            c for c in self.open if c.idle_since is not None and (host is None or c.host == host)
        ]
        return min(idle, key=lambda c: c.idle_since or 0.0) if idle else None

    def _drop(self, conn: Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.hosts.release(conn.host, 1)

    def lost(self, conn: Connection) -> None:
        self._drop(conn)

    def sweep(self, now: float | None = None) -> int:
        """Closes the connections idle past the timeout and lets each other
        one check its own time limits; returns how many were idle."""
        now = time.monotonic() if now is None else now
        deadline = now - self._idle_s
        stale = [c for c in self.open if c.idle_since is not None and c.idle_since < deadline]
        for conn in stale:
            self._drop(conn)
            conn.close()
        for conn in list(self.open):
            conn.tick(now)
        return len(stale)
