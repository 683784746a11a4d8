"""The quorum decision: a pure function of time, members and heartbeats.

Nothing here reads a clock, opens a socket or takes a lock. The server gathers
the state, passes `now` in (monotonic seconds) and acts on the decision, so
every clause of the rule is tested as a plain function (tests/unit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as it presents itself to the lighthouse."""

    replica_id: str
    """`{name}:{uuid}`; a restarted process is a new member."""
    address: str = ""
    """URL of the group's ManagerServer, e.g. `http://host:port`."""
    store_address: str = ""
    """`host:port` of the group's TCPStore, used for the cross-group rendezvous."""
    step: int = 0
    world_size: int = 1
    shrink_only: bool = False
    data: str | dict[str, Any] | None = ""
    """Free-form JSON the member shares with the others: the JSON text inside
    the lighthouse and on the wire; `LighthouseClient.quorum` hands it out
    decoded (a dict, or None when empty), as pytorch/torchft does."""
    commit_failures: int = 0


@dataclass(frozen=True)
class Quorum:
    """The members that train the next step together."""

    quorum_id: int
    participants: tuple[QuorumMember, ...]
    created: float
    """Wall-clock time of issue, seconds since the epoch."""

    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.participants)


@dataclass(frozen=True, kw_only=True)
class LighthouseConfig:
    """Options of the quorum rule. Field names carry their unit."""

    min_replicas: int
    """Fewest participants a new quorum may have."""
    join_timeout_ms: int = 60000
    """How long a valid quorum waits for healthy stragglers after the first join."""
    quorum_tick_ms: int = 100
    """How often the server re-runs the decision for waiting callers."""
    heartbeat_timeout_ms: int = 5000
    """A replica silent for longer than this is no longer healthy."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at least 1")
        for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
            value = getattr(self, name)
            if value < 0 or (value == 0 and name != "join_timeout_ms"):
                raise ValueError(f"{name} ({value}) must be positive")

    @property
    def forget_after_s(self) -> float:
        """Silence after which a replica is forgotten (bounds memory under churn)."""
        return max(10 * self.heartbeat_timeout_ms / 1000, 60.0)


@dataclass(frozen=True)
class Participant:
    """A replica waiting in a Quorum call."""

    member: QuorumMember
    joined_at: float
    """Monotonic seconds when it (re)joined."""


@dataclass(frozen=True)
class LighthouseState:
    participants: Mapping[str, Participant]
    heartbeats: Mapping[str, float]
    """replica_id -> monotonic seconds of its last heartbeat or Quorum call."""
    prev_quorum: Quorum | None = None
    streams_closed: Mapping[str, float] = field(default_factory=dict)
    """replica_id -> monotonic seconds when its last heartbeat stream ended
    without a Leave: its process most likely died and its connection closed."""
    started_at: float = float("-inf")
    """Monotonic seconds when this lighthouse started (see compute_quorum)."""


@dataclass(frozen=True)
class QuorumDecision:
    members: tuple[QuorumMember, ...] | None
    """The next quorum, sorted by replica_id; None while it cannot be formed."""
    reason: str
    """Why, in words; also the log line and the status-page text."""
    kind: str
    """Stable short code of the reason (`fast`, `valid`, `stragglers`, ...)."""


def stream_closed_since_heartbeat(
    heartbeats: Mapping[str, float], streams_closed: Mapping[str, float]
) -> set[str]:
    """Replicas whose heartbeat stream ended after their last heartbeat.

    A live group keeps its stream open however slow it is, so a stream that
    ends without a Leave means the process (or its connection) is gone: no
    need to wait for the heartbeat timeout. Any later heartbeat or Quorum call
    (a reconnect after a lighthouse restart or a network blip) outdates it.
    """
    return {
        rid
        for rid, closed in streams_closed.items()
        if rid in heartbeats and closed >= heartbeats[rid]
    }


def healthy_replicas(
    now: float,
    heartbeats: Mapping[str, float],
    timeout_ms: int,
    streams_closed: Mapping[str, float] | None = None,
) -> set[str]:
    """Replicas heard from within the timeout, less those whose stream closed since."""
    healthy = {rid for rid, seen in heartbeats.items() if now - seen < timeout_ms / 1000}
    if streams_closed:
        healthy -= stream_closed_since_heartbeat(heartbeats, streams_closed)
    return healthy


def compute_quorum(now: float, state: LighthouseState, config: LighthouseConfig) -> QuorumDecision:
    """Decides whether a quorum can be issued now, following DESIGN.md's rule."""
    heard = healthy_replicas(now, state.heartbeats, config.heartbeat_timeout_ms)
    gone = heard & stream_closed_since_heartbeat(state.heartbeats, state.streams_closed)
    healthy = heard - gone
    joined = {rid: p for rid, p in state.participants.items() if rid in healthy}
    shrink_only = any(p.member.shrink_only for p in joined.values())
    prev_ids = set(state.prev_quorum.replica_ids()) if state.prev_quorum else set()
    candidates = dict(joined)
    if state.prev_quorum is not None and shrink_only:
        candidates = {rid: p for rid, p in joined.items() if rid in prev_ids}
    members = tuple(candidates[rid].member for rid in sorted(candidates))
    tally = f"[{len(joined)}/{len(healthy)} participants healthy]"
    if shrink_only:
        tally += "[shrink_only]"
    # Who is missing, by name: the first thing a user asks of a stalled quorum.
    if healthy - joined.keys():
        tally += f"[healthy, not joined: {_some(healthy - joined.keys())}]"
    if gone:
        tally += f"[{len(gone)} gone: heartbeat stream closed: {_some(gone)}]"
    silent = state.heartbeats.keys() - heard - state.participants.keys()
    if silent:
        tally += f"[{len(silent)} silent past the heartbeat timeout: {_some(silent)}]"

    if state.prev_quorum is not None and prev_ids <= joined.keys() and members:
        return QuorumDecision(members, f"fast quorum: every previous member joined {tally}", "fast")
    if len(candidates) < config.min_replicas:
        return QuorumDecision(
            None,
            f"waiting for replicas: {len(candidates)} joined, "
            f"min_replicas is {config.min_replicas} {tally}",
            "too_few",
        )
    if len(candidates) <= len(healthy) / 2:
        return QuorumDecision(
            None,
            f"no majority: {len(candidates)} joined of {len(healthy)} healthy, "
            f"need more than half to avoid split brain {tally}",
            "split_brain",
        )
    stragglers = len(healthy) - len(joined)
    if stragglers > 0:
        first_join = min(p.joined_at for p in candidates.values())
        left_s = config.join_timeout_ms / 1000 - (now - first_join)
        if left_s > 0:
            plural = "" if stragglers == 1 else "s"
            return QuorumDecision(
                None,
                f"waiting for {stragglers} healthy straggler{plural}, "
                f"join timeout in {left_s:.1f} s {tally}",
                "stragglers",
            )
        return QuorumDecision(
            members, f"join timeout passed, quorum without stragglers {tally}", "join_timeout"
        )
    # A lighthouse that just (re)started has not heard from every live replica
    # yet. When the job was already training (a member past step 0), give the
    # others half a heartbeat timeout since the start (at most the join
    # timeout) to reconnect, rather than issue a quorum of the first caller
    # alone and make the rest heal. Half: a caller that sends no heartbeats
    # besides its Quorum call must still be healthy when the wait ends.
    if state.prev_quorum is None and any(m.step > 0 for m in members):
        first_join = min(p.joined_at for p in candidates.values())
        left_s = min(
            config.heartbeat_timeout_ms / 2000 - (now - state.started_at),
            config.join_timeout_ms / 1000 - (now - first_join),
        )
        if left_s > 0:
            return QuorumDecision(
                None,
                f"lighthouse restarted mid-job: waiting {left_s:.1f} s for replicas "
                f"to reconnect {tally}",
                "restart_grace",
            )
    return QuorumDecision(members, f"every healthy replica joined {tally}", "valid")


def _some(ids: set[str] | frozenset[str]) -> str:
    """The first three ids, sorted, for a log line that stays one line."""
    first = sorted(ids)[:3]
    return ", ".join(first) + (", ..." if len(ids) > 3 else "")


def quorum_changed(prev: Quorum | None, members: tuple[QuorumMember, ...]) -> bool:
    """Whether the next quorum needs a new id: new member list or a failed commit."""
    if prev is None:
        return True
    if tuple(m.replica_id for m in members) != prev.replica_ids():
        return True
    return any(m.commit_failures > 0 for m in members)


def next_quorum_id(prev_id: int, wall_ms: int) -> int:
    """Next id: above the previous one and at least the wall clock in milliseconds.

    Ids are never below the wall-clock time of their issue, so a restarted
    lighthouse (starting from its own clock) never repeats an id issued before,
    without persisting anything. Needs a clock that does not jump back by more
    than the restart gap.
    """
    return max(prev_id + 1, wall_ms)


def forgotten_replicas(
    now: float, heartbeats: Mapping[str, float], forget_after_s: float
) -> list[str]:
    """Replicas silent for so long that the lighthouse drops every trace of them."""
    return [rid for rid, seen in heartbeats.items() if now - seen > forget_after_s]
