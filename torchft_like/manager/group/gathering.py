"""One gathering of a replica group's ranks: a quorum request or a commit vote.

The bookkeeping both of the server's gatherings share (who called, who gave
up, the earliest deadline, who to name when it stalls), independent of gRPC
and of the lighthouse.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from lighthouse.rpc.errors import QuorumError

T = TypeVar("T")


@dataclass
class Round(Generic[T]):
    """Calls of one collective gathering (a quorum or a commit vote) by group rank."""

    calls: dict[int, T] = field(default_factory=dict)
    futures: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)
    """Deadline (monotonic) of each waiting call; the earliest bounds the whole
    wait. Per call, so that a call that gave up takes its deadline with it."""
    asked: set[int] = field(default_factory=set)
    """Every rank that called in this round, also those that gave up since."""
    untrusted: dict[int, float] = field(default_factory=dict)
    """Ranks whose waiting call may be a stray one -> when it came
    (admission); quorum rounds only."""

    def join(self, group_rank: int, call: T, deadline: float) -> asyncio.Future[Any]:
        """Registers a rank's call; a second call of the same rank supersedes the first."""
        old = self.futures.get(group_rank)
        if old is not None and not old.done():
            old.set_exception(QuorumError(f"group rank {group_rank} asked again; superseded"))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls[group_rank] = call
        self.futures[group_rank] = future
        self.deadlines[group_rank] = deadline
        self.asked.add(group_rank)
        return future

    def leave(self, group_rank: int, future: asyncio.Future[Any]) -> None:
        """Drops a call that gave up unanswered, so it is not counted nor answered."""
        if self.futures.get(group_rank) is future and not future.done():
            del self.calls[group_rank], self.futures[group_rank]
            self.deadlines.pop(group_rank, None)
            self.untrusted.pop(group_rank, None)

    def missing(self, world_size: int) -> list[int]:
        """Ranks without a waiting call: the round completes when there are none."""
        return [rank for rank in range(world_size) if rank not in self.calls]

    def stall_reason(self, world_size: int, what: str, wait_s: float) -> str:
        """Who kept the round from completing: ranks that never called, and
        ranks that called but gave up before the others came."""
        never = [rank for rank in range(world_size) if rank not in self.asked]
        gave_up = sorted(self.asked - self.calls.keys())
        reason = f"group ranks {never} did not {what} within {wait_s:.1f} s"
        if gave_up:
            reason += f" (ranks {gave_up} did but gave up waiting)"
        return reason
