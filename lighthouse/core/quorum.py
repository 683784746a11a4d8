"""The quorum decision: a pure function of time, members and heartbeats.

Nothing here reads a clock, opens a socket or takes a lock. The server gathers
the state, passes `now` in (monotonic seconds) and acts on the decision, so
every clause of the rule is tested as a plain function (tests/unit).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from lighthouse.core.compat import refusals

# Their home is lighthouse.core.members; imported from here too, as they always were.
from lighthouse.core.members import Quorum as Quorum
from lighthouse.core.members import QuorumMember as QuorumMember


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
    suspect_phi: float = 8.0
    """Suspicion (phi accrual, see suspicion()) above which a silent replica is
    taken as hung and left out of the next quorum, long before the heartbeat
    timeout; 8 means the silence had odds of 1e-8 under its usual heartbeat
    rhythm. 0: off, only the heartbeat timeout counts."""
    suspect_min_ms: int = 700
    """Never suspect a replica silent for less than this, whatever its rhythm:
    GIL contention and a loaded machine delay heartbeats by hundreds of ms."""
    allow_fresh_start: bool = False
    """Issue a quorum whose members are all at step 0 even though the job
    already committed steps (see fresh_start_refusal): a deliberate restart
    from fresh weights."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at least 1")
        if self.suspect_phi < 0:
            raise ValueError(f"suspect_phi ({self.suspect_phi}) must be 0 (off) or positive")
        if self.suspect_min_ms < 0:
            raise ValueError(f"suspect_min_ms ({self.suspect_min_ms}) must not be negative")
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


ARRIVAL_WEIGHT = 0.1
"""Weight of the newest interval in the running mean and variance (about the
last 10-20 heartbeats count)."""
MIN_ARRIVALS = 10
"""Intervals seen before a replica can be suspected: a rhythm needs samples."""
MIN_STD_S = 0.05
"""Floor of the interval's standard deviation: a perfectly regular sender
would otherwise be suspected at its first slight delay."""


@dataclass(frozen=True)
class ArrivalStats:
    """Running mean and variance of one replica's heartbeat intervals."""

    mean_s: float
    var_s2: float
    count: int


def record_arrival(stats: ArrivalStats | None, interval_s: float, cap_s: float) -> ArrivalStats:
    """Adds one heartbeat interval (exponentially weighted). Intervals are
    capped at `cap_s` (the heartbeat timeout), so one outage (a stop, a
    lighthouse restart) widens the rhythm for a while instead of for good."""
    x = min(max(interval_s, 0.0), cap_s)
    if stats is None:
        return ArrivalStats(x, 0.0, 1)
    diff = x - stats.mean_s
    mean = stats.mean_s + ARRIVAL_WEIGHT * diff
    var = (1 - ARRIVAL_WEIGHT) * (stats.var_s2 + ARRIVAL_WEIGHT * diff * diff)
    return ArrivalStats(mean, var, stats.count + 1)


def suspicion(silence_s: float, stats: ArrivalStats) -> float:
    """Phi accrual (Hayashibara et al.): -log10 of the odds that a heartbeat
    is still this late under the replica's usual rhythm (intervals taken as
    normal). Grows with the silence; inf when the odds underflow."""
    std = max(math.sqrt(stats.var_s2), MIN_STD_S)
    p_later = 0.5 * math.erfc((silence_s - stats.mean_s) / (std * math.sqrt(2)))
    return -math.log10(p_later) if p_later > 0 else math.inf


def suspected_replicas(
    now: float,
    heartbeats: Mapping[str, float],
    arrivals: Mapping[str, ArrivalStats],
    config: LighthouseConfig,
) -> dict[str, float]:
    """Replicas silent far beyond their usual heartbeat rhythm -> silence (s).

    A stopped process (SIGSTOP, a whole machine frozen) keeps its connection
    open, so only its silence tells; waiting out the heartbeat timeout stalls
    every other group that long each time. A replica is suspected when its
    suspicion exceeds `suspect_phi`, it has been silent at least
    `suspect_min_ms`, and enough intervals were seen to know its rhythm.
    """
    if config.suspect_phi <= 0:
        return {}
    floor_s = config.suspect_min_ms / 1000
    found = {}
    for rid, seen in heartbeats.items():
        silence_s = now - seen
        stats = arrivals.get(rid)
        if silence_s < floor_s or stats is None or stats.count < MIN_ARRIVALS:
            continue
        if suspicion(silence_s, stats) > config.suspect_phi:
            found[rid] = silence_s
    return found


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
    arrivals: Mapping[str, ArrivalStats] = field(default_factory=dict)
    """replica_id -> its heartbeat rhythm, for suspected_replicas."""
    described: Mapping[str, QuorumMember] = field(default_factory=dict)
    """replica_id -> its latest self-description (its last Quorum call), so a
    live replica not waiting now still counts for lighthouse.core.compat."""
    high_water_step: int = 0
    """The highest step of any issued quorum's member, kept across lighthouse
    restarts by its state file (lighthouse.shell.state_file)."""
    held_state: AbstractSet[str] = frozenset()
    """Replicas that asked for a quorum at a step past 0 themselves: one
    that then asks at step 0 went back on purpose (fresh_start_refusal)."""
    restored: bool = False
    """`prev_quorum` was read from the state file at start and no quorum has
    been issued since: its members are the replicas to wait for."""


@dataclass(frozen=True)
class QuorumDecision:
    members: tuple[QuorumMember, ...] | None
    """The next quorum, sorted by replica_id; None while it cannot be formed."""
    reason: str
    """Why, in words; also the log line and the status-page text."""
    kind: str
    """Stable short code of the reason (`fast`, `valid`, `stragglers`, ...)."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Replicas left out because they cannot share an allreduce with the
    others (lighthouse.core.compat) -> the error their Quorum call gets."""


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


def group_name(replica_id: str) -> str:
    """The replica group part of a `{name}:{uuid}` id (an id without ':' is
    its own name): the uuid changes with every process start, the name not."""
    name, colon, _ = replica_id.rpartition(":")
    return name if colon else replica_id


def twin_refusal(
    now: float,
    replica_id: str,
    same_name: Iterable[str],
    heartbeats: Mapping[str, float],
    timeout_ms: int,
    streams_closed: Mapping[str, float] | None = None,
) -> str | None:
    """Why `replica_id` must be refused as a second live group of its name, or None.

    Two live processes training as one replica group (a restarted torchrun
    while the old one still runs, or a REPLICA_GROUP_ID given twice) would
    train the same data shard twice and corrupt the group's place in the
    quorum. The replica already known and healthy keeps the name; a newcomer
    is refused until that one is dead (stream closed, or silent past the
    heartbeat timeout) or has left.

    Args:
        same_name: the known replica ids of the same group name (the caller
            keeps an index, so a heartbeat costs no scan of every replica).
    """
    others = {rid for rid in same_name if rid != replica_id}
    if not others:
        return None
    live = healthy_replicas(
        now,
        {rid: heartbeats[rid] for rid in others if rid in heartbeats},
        timeout_ms,
        streams_closed,
    )
    if not live:
        return None
    holder = min(live)
    return (
        f"replica group {group_name(replica_id)!r} is already live as {holder} "
        f"(heard from {now - heartbeats[holder]:.1f} s ago); refusing {replica_id}: "
        "a group id must be unique among live groups. Stop the other process first "
        "(it is released as soon as it dies or leaves), or give this one another "
        "REPLICA_GROUP_ID"
    )


def compute_quorum(now: float, state: LighthouseState, config: LighthouseConfig) -> QuorumDecision:
    """Decides whether a quorum can be issued now (docs/architecture.md, "The quorum rule")."""
    heard = healthy_replicas(now, state.heartbeats, config.heartbeat_timeout_ms)
    gone = heard & stream_closed_since_heartbeat(state.heartbeats, state.streams_closed)
    # Hung (e.g. SIGSTOP): silent far past its rhythm; left out like the dead,
    # and healthy again with its next heartbeat.
    hung = {
        rid: s
        for rid, s in suspected_replicas(now, state.heartbeats, state.arrivals, config).items()
        if rid in heard and rid not in gone
    }
    healthy = heard - gone - hung.keys()
    # A group of another rendezvous (a torchft nightly beside torchft_like)
    # would stall every configure: refused, and not counted as healthy, so
    # it holds up neither the majority nor the join timeout.
    described = {
        rid: p.member if (p := state.participants.get(rid)) else state.described[rid]
        for rid in healthy
        if rid in state.participants or rid in state.described
    }
    refused = refusals(described, state.prev_quorum.replica_ids() if state.prev_quorum else ())
    healthy -= refused.keys()
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
    if hung:
        first = sorted(hung)[:3]
        tally += (
            f"[{len(hung)} suspected hung: "
            + ", ".join(
                f"{rid} silent {hung[rid]:.1f} s, usually every {state.arrivals[rid].mean_s:.2f} s"
                for rid in first
            )
            + (", ...]" if len(hung) > 3 else "]")
        )
    silent = state.heartbeats.keys() - heard - state.participants.keys()
    if silent:
        tally += f"[{len(silent)} silent past the heartbeat timeout: {_some(silent)}]"
    if refused:
        tally += f"[{len(refused)} refused, another rendezvous: {_some(set(refused))}]"
    decision = _decide(now, state, config, candidates, joined, healthy, members, prev_ids, tally)
    # A veto of the quorum the rule would issue, not a rule of who to wait for.
    veto = fresh_start_refusal(
        decision.members, state.high_water_step, config.allow_fresh_start, state.held_state
    )
    if veto is not None:
        # A live group that holds the job's state but is between quorums
        # (reconfiguring, healing others, failing a step) is waited for, not
        # given up on: it asks again within a step, and then all heal from it.
        holders = {rid for rid in healthy - joined.keys() if rid in described}
        holders = {rid for rid in holders if described[rid].step > 0}
        if holders:
            why = f"waiting for {_some(holders)}: live and holding the job's state, not asking yet"
            decision = QuorumDecision(None, f"{why} {tally}", "holder_wait")
        else:
            decision = QuorumDecision(None, f"{veto} {tally}", "fresh_start")
    return replace(decision, refused=refused) if refused else decision


def _decide(
    now: float,
    state: LighthouseState,
    config: LighthouseConfig,
    candidates: Mapping[str, Participant],
    joined: Mapping[str, Participant],
    healthy: set[str],
    members: tuple[QuorumMember, ...],
    prev_ids: set[str],
    tally: str,
) -> QuorumDecision:
    """compute_quorum's rule, once the replicas are sorted out."""
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
    # besides its Quorum call must still be healthy when the wait ends. With
    # the previous quorum restored from the state file, only its members not
    # yet back are waited for (all back: the fast quorum above, no wait).
    missing = prev_ids - joined.keys() if state.restored else set()
    if (state.prev_quorum is None or missing) and any(m.step > 0 for m in members):
        first_join = min(p.joined_at for p in candidates.values())
        left_s = min(
            config.heartbeat_timeout_ms / 2000 - (now - state.started_at),
            config.join_timeout_ms / 1000 - (now - first_join),
        )
        if left_s > 0:
            who = f"previous members {_some(missing)}" if missing else "replicas"
            return QuorumDecision(
                None,
                f"lighthouse restarted mid-job: waiting {left_s:.1f} s for {who} "
                f"to reconnect {tally}",
                "restart_grace",
            )
    return QuorumDecision(members, f"every healthy replica joined {tally}", "valid")


def fresh_start_refusal(
    members: tuple[QuorumMember, ...] | None,
    high_water_step: int,
    allow_fresh_start: bool,
    held_state: AbstractSet[str] = frozenset(),
) -> str | None:
    """Why the quorum of `members` the rule would issue must not be, or None.

    Every member at step 0 while the job already committed steps means no
    live group holds the job's state: a group whose heal source died, or a
    replacement that came after the others finished. Issued, it would train
    from fresh weights and throw the job's progress away without a word. A
    group restored from a durable checkpoint (any step past 0, even below
    the mark) is fine; a deliberate fresh start needs `allow_fresh_start`.
    So is a replica in `held_state`, which asked at a step past 0 itself and
    now asks at 0: no newcomer, but a caller that chose to go back (as
    pytorch/torchft's lighthouse tests do).
    """
    if allow_fresh_start or high_water_step <= 0 or not members:
        return None
    if any(m.step > 0 or m.replica_id in held_state for m in members):
        return None
    return (
        f"refusing to train from step 0: the job already committed step {high_water_step} "
        "(the lighthouse's high-water mark) and no live replica group holds a step past 0 to "
        "heal from; restart the replica groups from their durable checkpoint "
        "(torchft_like.checkpointing.durable) or bring back a group that holds the job's "
        "state, or, to train from fresh weights on purpose, restart the lighthouse with "
        "--allow-fresh-start"
    )


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


@dataclass(frozen=True)
class JobMark:
    """What a lighthouse keeps across its own restart (its state file,
    lighthouse.shell.state_file): the job's high-water step and last quorum."""

    high_water_step: int = 0
    quorum_id: int = 0
    members: tuple[str, ...] = ()
    """Replica ids of the last issued quorum."""
    saved_at: float = 0.0
    """Wall-clock seconds when that quorum was issued."""

    def quorum(self) -> Quorum | None:
        """The last quorum as far as the file knows it (ids only), or None."""
        if not self.members:
            return None
        members = tuple(QuorumMember(rid) for rid in sorted(self.members))
        return Quorum(self.quorum_id, members, self.saved_at)
