"""Fair shares of a server's process-wide pools between the hosts it serves.

A pool with only a total (request bytes held, message grants, connections,
memory, a loop turn's work) lets one host fill it for everyone: its
connections take what a healthy host's next call needs. Here each host may
hold at most `cap // (others + 2)`, where `others` is the number of other
hosts holding some: alone it gets half, and with k hosts holding there is
always 1/(k+2) of the pool left for one more. A healthy host that arrives
while one host fills the pool therefore finds room, and the filling host is
refused first. Pure bookkeeping: no clock, no I/O; a host is a string (an
address without its port).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lighthouse.rpc.h2.limits import LIMITS, Limits


def fair_limit(cap: int, others: int) -> int:
    """What one host may hold while `others` other hosts hold some of `cap`
    (at least 1: a host is never shut out while the pool has room)."""
    return max(1, cap // (others + 2))


class HostShares:
    """One pool: its total, and what each host holds of it."""

    __slots__ = ("cap", "total", "by_host")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self.by_host: dict[str, int] = {}

    def limit(self, host: str) -> int:
        """What `host` may hold now."""
        others = len(self.by_host) - (host in self.by_host)
        return fair_limit(self.cap, others)

    def take(self, host: str, n: int) -> bool:
        """Counts `n` more for `host`; False (nothing counted) past the pool
        or past the host's share."""
        by_host = self.by_host
        have = by_host.get(host, 0)
        total = self.total + n
        if total > self.cap:
            return False
        others = len(by_host) - (1 if have else 0)  # a host that holds none is not kept
        if have + n > fair_limit(self.cap, others):
            return False
        self.total = total
        by_host[host] = have + n
        return True

    def add(self, host: str, n: int) -> None:
        """Counts `n` that is held whether or not it fits (an answer already
        made); `take` then refuses the host what it asks for next."""
        self.total += n
        self.by_host[host] = self.by_host.get(host, 0) + n

    def release(self, host: str, n: int) -> None:
        have = self.by_host.get(host, 0) - n
        self.total -= n
        if have > 0:
            self.by_host[host] = have
        else:
            self.by_host.pop(host, None)

    def held(self, host: str) -> int:
        return self.by_host.get(host, 0)

    def over(self, host: str) -> bool:
        """The host holds more than its share (others have come since it took)."""
        have = self.by_host.get(host, 0)
        return have > 0 and have > self.limit(host)


class TurnShares:
    """Work units per host in one turn of the event loop: each host's
    connections together get `per_host` a turn, so a host that floods with
    many connections gets a host's turn, not one per connection. The first
    spend of a turn asks `call_soon` for the next turn's reset; callbacks
    scheduled in a turn run in the next, after it."""

    __slots__ = ("per_host", "spent", "_call_soon", "_pending")

    def __init__(self, per_host: int, call_soon: Callable[[Callable[[], None]], object]) -> None:
        self.per_host = per_host
        self.spent: dict[str, int] = {}
        self._call_soon = call_soon
        self._pending = False

    def left(self, host: str) -> int:
        return self.per_host - self.spent.get(host, 0)

    def spend(self, host: str, units: int) -> None:
        if units <= 0:
            return
        self.spent[host] = self.spent.get(host, 0) + units
        if not self._pending:
            self._pending = True
            self._call_soon(self._new_turn)

    def _new_turn(self) -> None:
        self._pending = False
        self.spent.clear()


def _call_soon(callback: Callable[[], None]) -> object:
    return asyncio.get_event_loop().call_soon(callback)


class ProcessBudget:
    """The pools every connection of one server draws on, each shared
    fairly between hosts: what many peers together may make it hold or do."""

    def __init__(self, limits: Limits = LIMITS) -> None:
        self.limits = limits
        self.held = HostShares(limits.process_held)
        """Request bytes received and not consumed, partial frames and header blocks."""
        self.grants = HostShares(limits.process_grants)
        self.memory = HostShares(limits.process_memory)
        self.turn = TurnShares(limits.work_per_host_turn, _call_soon)
        self.calmed: dict[str, int] = {}
        """Connections closed with ENHANCE_YOUR_CALM for a frame flood, by kind
        (Connection.calm: "priority", "empty_data", ...)."""
