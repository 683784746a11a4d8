"""Each group rank's share of a quorum: its rank, the primary store, who
heals from whom (docs/architecture.md, "One training step", point 2).

Pure and deterministic, so every ManagerServer that reads the member list
derives the same assignment without talking to the others; the lighthouse
runs the same rules (`QuorumViews`) to answer a group that asks for its
view alone, a few hundred bytes instead of every member. That includes
divergence: replicas at the same step whose state fingerprints differ
(shared in QuorumMember.data) are told apart here, and the odd ones heal
like replicas that are behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lighthouse.core.member_data import batch_slot_of, fingerprint_of
from lighthouse.core.quorum import Quorum, QuorumMember

MAX_SOURCES = 64
"""Most replicas one healing rank is told it may fetch from (striped
healing uses a few: TORCHFT_HEAL_SOURCES); all of them would make a healing
group's answer grow with the job."""
MAX_VIEW_RANKS = 4096
"""Most group ranks a lighthouse answers views for: a group's world_size
past it is refused, so a forged request cannot make it compute without end."""


@dataclass(frozen=True)
class QuorumResult:
    """What one rank of one replica group needs to know about a quorum."""

    quorum_id: int
    replica_rank: int
    """Our index among the participants, sorted by replica_id."""
    replica_world_size: int
    store_address: str
    """TCPStore of the primary for our group rank: where the process group meets."""
    max_step: int
    max_replica_rank: int | None
    """Our index among the participants at max_step, or None if we are behind."""
    max_world_size: int
    heal: bool
    """We must copy the state from `recover_src_*` before stepping."""
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: tuple[int, ...] = ()
    recover_src_replica_ranks: tuple[int, ...] = ()
    """Every replica we may heal from, striped (see HTTPTransport
    `recv_checkpoint_striped`): all up-to-date replicas, our primary source
    first. Empty when we do not heal."""
    recover_src_manager_addresses: tuple[str, ...] = ()
    """Their ManagerServer addresses, in the same order."""
    recover_stripe_dst_replica_ranks: tuple[int, ...] = ()
    """Every healing replica that may fetch a stripe of our state: all of
    them when we are up to date (a superset of recover_dst_replica_ranks)."""
    commit_failures: int = 0
    divergence: str = ""
    """Why some replicas at max_step heal although up to date (their state
    fingerprint is the odd one out), or empty. Not sent to the ranks."""
    batch_slots_wrong: str = ""
    """Why the participants (the replicas at max_step) did not all take the
    batch the quorum gives them (batch_slots_wrong), or empty."""
    batch_slots_wrong_all: str = ""
    """The same when every member counts (a synchronous quorum)."""


def member_fingerprint(member: QuorumMember, group_rank: int) -> str | None:
    """The fingerprint `member` shared for `group_rank` at its current step
    (lighthouse.core.member_data.fingerprint_of), or None."""
    return fingerprint_of(member.data, member.step, group_rank)


@dataclass(frozen=True)
class Divergence:
    """Replicas at one step whose fingerprints for one group rank differ."""

    odd: tuple[str, ...]
    """Replica ids that must heal, sorted."""
    kept: tuple[str, ...]
    """Replica ids whose state is kept, sorted."""
    reason: str


def find_divergence(at_max: Sequence[QuorumMember], group_rank: int) -> Divergence | None:
    """Which replicas at max_step hold the wrong state for `group_rank`.

    The rule: the fingerprint most replicas share is kept; on a tie, the one
    held by the lowest replica_id. Why: faults (a flipped bit, a bad host)
    hit one replica at a time, so the value most replicas agree on is the
    likely right one. A tie (always so with 2 replicas) carries no evidence
    either way, so the rule only has to be one every replica computes
    identically from the quorum alone: the lowest replica_id, with the usual
    `{name}_{group}:{uuid}` ids the lowest-numbered group, which an operator
    can predict. Replicas that shared no fingerprint are left out.
    """
    by_value: dict[str, list[str]] = {}
    sharing = [m for m in at_max if m.data]  # most jobs share nothing: no sort, no call
    for member in sorted(sharing, key=lambda m: m.replica_id):
        value = member_fingerprint(member, group_rank)
        if value is not None:
            by_value.setdefault(value, []).append(member.replica_id)
    if len(by_value) < 2:
        return None
    # Ties keep the value seen first, i.e. the lowest replica_id's.
    kept_value = max(by_value, key=lambda v: len(by_value[v]))
    kept = tuple(by_value[kept_value])
    odd = tuple(sorted(r for v, ids in by_value.items() if v != kept_value for r in ids))
    others = "; ".join(
        f"{v} held by {', '.join(ids)}" for v, ids in by_value.items() if v != kept_value
    )
    majority = all(len(ids) < len(kept) for v, ids in by_value.items() if v != kept_value)
    reason = (
        f"state fingerprints differ at step {at_max[0].step} for group rank {group_rank}: "
        f"keeping {kept_value} held by {', '.join(kept)} "
        f"({'majority' if majority else 'tie, lowest replica_id'}); {others}; "
        f"healing {', '.join(odd)} from a kept replica"
    )
    return Divergence(odd=odd, kept=kept, reason=reason)


def batch_claims(members: Sequence[QuorumMember]) -> dict[str, int | None]:
    """Each member's claimed batch slot (lighthouse.core.member_data.batch_slot_of), read once."""
    return {m.replica_id: batch_slot_of(m.data) for m in members}


def batch_slots_wrong(participants: list[QuorumMember], claims: Mapping[str, int | None]) -> str:
    """Why the step's batches are not the quorum's, or "" when they are.

    Participant r (in the order given, the order of participating ranks)
    must train unit `batches_committed + r` of the data; a group that took
    its batch by predicting its rank (torchft_like.StepBatches) says which
    rank it predicted. Every replica reads the same quorum, so all agree on
    the answer and none commits a step whose samples would be counted for
    the wrong group. Members that claim nothing are not checked.
    """
    for rank, member in enumerate(participants):
        claim = claims[member.replica_id]
        if claim is None or claim == rank:
            continue
        took = "no batch slot (it had no quorum yet)" if claim < 0 else f"batch slot {claim}"
        return (
            f"replica {member.replica_id} took {took} but is participant {rank} of "
            f"{len(participants)}: the participants changed since its last quorum; the step "
            "is retried with the new assignment"
        )
    return ""


@dataclass(frozen=True)
class _Kept:
    """What the plans of every group rank with the same odd replicas share:
    computed once, not once per group rank (O(members) each)."""

    at_max_ids: dict[str, int]
    """Replica id -> index among those at max_step that keep their state."""
    recovering: dict[str, int]
    """Replica id -> its index among the recovering."""
    recovering_ranks: tuple[int, ...]
    up_to_date: list[QuorumMember]
    up_to_date_ids: frozenset[str]
    batch_slots_wrong: str


@dataclass(frozen=True)
class _RankPlan:
    """What every member's result for one group rank shares."""

    primary: QuorumMember
    divergence: Divergence | None
    kept: _Kept
    """The same object for every group rank with the same odd replicas."""
    serving: dict[str, tuple[int, ...]]
    """Source replica id -> the replica ranks that heal from it."""


class QuorumViews:
    """Every member's share of one quorum, each rule applied once for all:
    `result(replica_id, group_rank)` is O(1) (plus its heal sources) after
    O(members) once per group rank, where computing each member's from the
    member list would cost O(members) each."""

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self.participants = sorted(quorum.participants, key=lambda m: m.replica_id)
        self.rank_of = {m.replica_id: i for i, m in enumerate(self.participants)}
        self.max_step = max((m.step for m in self.participants), default=0)
        self.at_max = [m for m in self.participants if m.step == self.max_step]
        self.commit_failures = max((m.commit_failures for m in self.participants), default=0)
        self._claims: dict[str, int | None] | None = None
        self._wrong_all: str | None = None
        self._plans: dict[tuple[int, bool], _RankPlan] = {}
        self._kept: dict[tuple[frozenset[str], bool], _Kept] = {}
        """By the odd replicas: group ranks without divergence share one (O(members))."""
        self._steady_everywhere: dict[tuple[int, bool], frozenset[str]] = {}
        self.memo: dict[object, object] = {}
        """What an encoder of these views keeps once per quorum (lighthouse.wire)."""

    def result(self, replica_id: str, group_rank: int, init_sync: bool) -> QuorumResult:
        """Raises ValueError: `replica_id` is not a participant."""
        replica_rank = self.rank_of.get(replica_id)
        if replica_rank is None:
            ids = list(self.rank_of)
            raise ValueError(
                f"replica {replica_id} is not in quorum {self.quorum.quorum_id} ({ids})"
            )
        plan = self._plan(group_rank, init_sync and self.max_step == 0)
        kept = plan.kept
        up_to_date = kept.up_to_date
        index = kept.recovering.get(replica_id)
        sources: list[QuorumMember] = []
        if index is not None:
            count = min(len(up_to_date), MAX_SOURCES)
            sources = [up_to_date[(index + j + group_rank) % len(up_to_date)] for j in range(count)]
        src = sources[0] if sources else None
        serves_stripes = replica_id not in kept.recovering and replica_id in kept.at_max_ids
        return QuorumResult(
            quorum_id=self.quorum.quorum_id,
            replica_rank=replica_rank,
            replica_world_size=len(self.participants),
            store_address=plan.primary.store_address,
            max_step=self.max_step,
            max_replica_rank=kept.at_max_ids.get(replica_id),
            max_world_size=len(kept.at_max_ids),
            heal=src is not None,
            recover_src_manager_address=src.address if src else "",
            recover_src_replica_rank=self.rank_of[src.replica_id] if src else None,
            recover_dst_replica_ranks=plan.serving.get(replica_id, ()),
            recover_src_replica_ranks=tuple(self.rank_of[m.replica_id] for m in sources),
            recover_src_manager_addresses=tuple(m.address for m in sources),
            recover_stripe_dst_replica_ranks=kept.recovering_ranks if serves_stripes else (),
            commit_failures=self.commit_failures,
            divergence=plan.divergence.reason if plan.divergence else "",
            batch_slots_wrong=kept.batch_slots_wrong,
            batch_slots_wrong_all=self._slots_wrong_all(),
        )

    def steady_for(self, replica_id: str, group_rank: int, init_sync: bool) -> bool:
        """Whether `replica_id`'s result for `group_rank` is `steady_share`
        with its own ranks: it is up to date and the primary source of no heal."""
        plan = self._plan(group_rank, init_sync and self.max_step == 0)
        return replica_id in plan.kept.up_to_date_ids and replica_id not in plan.serving

    def steady_share(self, group_rank: int, init_sync: bool) -> QuorumResult:
        """What every `steady_for` member's result for `group_rank` holds but
        its replica_rank and max_replica_rank (zero and None here)."""
        plan = self._plan(group_rank, init_sync and self.max_step == 0)
        kept = plan.kept
        return QuorumResult(
            quorum_id=self.quorum.quorum_id,
            replica_rank=0,
            replica_world_size=len(self.participants),
            store_address=plan.primary.store_address,
            max_step=self.max_step,
            max_replica_rank=None,
            max_world_size=len(kept.at_max_ids),
            heal=False,
            recover_stripe_dst_replica_ranks=kept.recovering_ranks,
            commit_failures=self.commit_failures,
            divergence=plan.divergence.reason if plan.divergence else "",
            batch_slots_wrong=kept.batch_slots_wrong,
            batch_slots_wrong_all=self._slots_wrong_all(),
        )

    def steady_everywhere(self, world_size: int, init_sync: bool) -> frozenset[str]:
        """The members whose result for every group rank below `world_size`
        is `steady_share` with the same two ranks: each group rank's plan
        keeps every member at max_step (no divergence), so a member's ranks
        do not depend on the group rank. O(members) once per world size."""
        key = (world_size, init_sync)
        ids = self._steady_everywhere.get(key)
        if ids is None:
            one_keeps = init_sync and self.max_step == 0
            plans = [self._plan(g, one_keeps) for g in range(world_size)]
            ids = frozenset()
            if not any(plan.divergence for plan in plans):
                ids = plans[0].kept.up_to_date_ids.difference(*(plan.serving for plan in plans))
            self._steady_everywhere[key] = ids
        return ids

    def ranks(self, replica_id: str, group_rank: int, init_sync: bool) -> tuple[int, int | None]:
        """`replica_id`'s replica_rank and max_replica_rank for `group_rank`."""
        plan = self._plan(group_rank, init_sync and self.max_step == 0)
        return self.rank_of[replica_id], plan.kept.at_max_ids.get(replica_id)

    def _claims_of(self) -> dict[str, int | None]:
        if self._claims is None:
            self._claims = batch_claims(self.participants)
        return self._claims

    def _slots_wrong_all(self) -> str:
        if self._wrong_all is None:
            self._wrong_all = batch_slots_wrong(self.participants, self._claims_of())
        return self._wrong_all

    def _plan(self, group_rank: int, one_keeps: bool) -> _RankPlan:
        key = (group_rank, one_keeps)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(group_rank, one_keeps)
        return plan

    def _make_plan(self, group_rank: int, one_keeps: bool) -> _RankPlan:
        at_max = self.at_max
        divergence = find_divergence(at_max, group_rank)
        odd = frozenset(divergence.odd) if divergence else frozenset()
        kept = self._kept.get((odd, one_keeps))
        if kept is None:
            kept = self._kept[odd, one_keeps] = self._make_kept(odd, one_keeps)
        serving: dict[str, list[int]] = {}
        up_to_date = kept.up_to_date
        for i, rank in enumerate(kept.recovering_ranks):
            source = up_to_date[(i + group_rank) % len(up_to_date)]
            serving.setdefault(source.replica_id, []).append(rank)
        return _RankPlan(
            primary=at_max[group_rank % len(at_max)],
            divergence=divergence,
            kept=kept,
            serving={k: tuple(v) for k, v in serving.items()},
        )

    def _make_kept(self, odd: frozenset[str], one_keeps: bool) -> _Kept:
        kept = [m for m in self.at_max if m.replica_id not in odd]
        if one_keeps:
            # One group keeps its weights for every group rank: a group's ranks
            # serve or heal together, as a state_dict with collectives needs.
            recovering = [m for m in self.participants if m.replica_id != kept[0].replica_id]
        else:
            recovering = [
                m for m in self.participants if m.step != self.max_step or m.replica_id in odd
            ]
        recovering_index = {m.replica_id: i for i, m in enumerate(recovering)}
        up_to_date = [m for m in kept if m.replica_id not in recovering_index]
        return _Kept(
            at_max_ids={m.replica_id: i for i, m in enumerate(kept)},
            recovering=recovering_index,
            recovering_ranks=tuple(self.rank_of[m.replica_id] for m in recovering),
            up_to_date=up_to_date,
            up_to_date_ids=frozenset(m.replica_id for m in up_to_date),
            batch_slots_wrong=batch_slots_wrong(kept, self._claims_of()),
        )


def compute_quorum_result(
    quorum: Quorum, replica_id: str, group_rank: int, init_sync: bool
) -> QuorumResult:
    """One rank's share of `quorum` (QuorumViews for one member).

    Sources are spread: the i-th recovering replica copies from up-to-date
    replica (i + group_rank) mod (number up to date), so recoveries of several
    replicas, and of the ranks of one group, do not all load one peer.

    Replicas at max_step whose state fingerprint is the odd one out (see
    find_divergence) heal too: they count as recovering, not as at max_step.

    For striped healing, each recovering replica lists the up-to-date
    replicas (at most MAX_SOURCES), starting at its own source and going
    round, so that several replicas healing at once start on (and fall back
    to) different peers; each up-to-date replica serves every recovering one.

    Raises:
        ValueError: `replica_id` is not a participant of `quorum`.
    """
    return QuorumViews(quorum).result(replica_id, group_rank, init_sync)
