"""Per-rank view of a quorum: our rank, the primary store, who heals from whom.

A pure function of (quorum, replica_id, group_rank, init_sync), so every
ManagerServer derives the same assignment without talking to the others.
That includes divergence: replicas at the same step whose state fingerprints
differ (shared in QuorumMember.data) are told apart here, and the odd ones
heal like replicas that are behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lighthouse.member_data import batch_slot_of, fingerprint_of
from lighthouse.quorum import Quorum, QuorumMember


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
    (lighthouse.member_data.fingerprint_of), or None."""
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
    for member in sorted(at_max, key=lambda m: m.replica_id):
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


def compute_quorum_result(
    quorum: Quorum, replica_id: str, group_rank: int, init_sync: bool
) -> QuorumResult:
    """Follows docs/architecture.md, "One training step", point 2.

    Sources are spread: the i-th recovering replica copies from up-to-date
    replica (i + group_rank) mod (number up to date), so recoveries of several
    replicas, and of the ranks of one group, do not all load one peer.

    Replicas at max_step whose state fingerprint is the odd one out (see
    find_divergence) heal too: they count as recovering, not as at max_step.

    For striped healing, each recovering replica lists every up-to-date
    replica, starting at its own source and going round, so that several
    replicas healing at once start on (and fall back to) different peers;
    each up-to-date replica serves every recovering one.

    Raises:
        ValueError: `replica_id` is not a participant of `quorum`.
    """
    participants = sorted(quorum.participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in participants]
    if replica_id not in ids:
        raise ValueError(f"replica {replica_id} is not in quorum {quorum.quorum_id} ({ids})")
    replica_rank = ids.index(replica_id)
    max_step = max(m.step for m in participants)
    at_max = [m for m in participants if m.step == max_step]
    primary = at_max[group_rank % len(at_max)]
    divergence = find_divergence(at_max, group_rank)
    odd = set(divergence.odd) if divergence else set()
    at_max = [m for m in at_max if m.replica_id not in odd]
    at_max_ids = [m.replica_id for m in at_max]

    recovering = [m for m in participants if m.step != max_step or m.replica_id in odd]
    if init_sync and max_step == 0:
        # One group keeps its weights for every group rank: a group's ranks
        # serve or heal together, as a state_dict with collectives needs.
        recovering = [m for m in participants if m.replica_id != at_max[0].replica_id]
    recovering_ids = {m.replica_id for m in recovering}
    up_to_date = [m for m in at_max if m.replica_id not in recovering_ids]

    def source_of(i: int) -> QuorumMember:
        return up_to_date[(i + group_rank) % len(up_to_date)]

    src: QuorumMember | None = None
    sources: list[QuorumMember] = []
    for i, member in enumerate(recovering):
        if member.replica_id == replica_id:
            src = source_of(i)
            sources = [source_of(i + j) for j in range(len(up_to_date))]
    serves_stripes = replica_id in {m.replica_id for m in up_to_date}
    dst = tuple(
        ids.index(m.replica_id)
        for i, m in enumerate(recovering)
        if source_of(i).replica_id == replica_id
    )
    claims = batch_claims(participants)
    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=at_max_ids.index(replica_id) if replica_id in at_max_ids else None,
        max_world_size=len(at_max),
        heal=src is not None,
        recover_src_manager_address=src.address if src else "",
        recover_src_replica_rank=ids.index(src.replica_id) if src else None,
        recover_dst_replica_ranks=dst,
        recover_src_replica_ranks=tuple(ids.index(m.replica_id) for m in sources),
        recover_src_manager_addresses=tuple(m.address for m in sources),
        recover_stripe_dst_replica_ranks=(
            tuple(ids.index(m.replica_id) for m in recovering) if serves_stripes else ()
        ),
        commit_failures=max(m.commit_failures for m in participants),
        divergence=divergence.reason if divergence else "",
        batch_slots_wrong=batch_slots_wrong(at_max, claims),
        batch_slots_wrong_all=batch_slots_wrong(participants, claims),
    )


@dataclass(frozen=True)
class BatchSlot:
    """A forecast of the next step's participation (Manager.claim_batch_slot)."""

    slot: int
    """Our participating rank: the unit of data we train is
    batches_committed + slot. -1 before any quorum."""
    participants: int
    """How many participate, each taking the next unit: the stride between
    our units of consecutive steps."""


def slot_forecast(
    result: QuorumResult, cap: int | None, committed: bool, participating: tuple[int, int | None]
) -> BatchSlot:
    """Next step's participation, forecast from this step's quorum `result`.

    If this step `committed`, every member of the quorum is likely to be at
    one step next and count, in replica_id order (spares, ranked past `cap`,
    keep their rank; they train no unit). If it did not, no one is likely
    to have committed, and the participants stay this step's
    (`participating`: their count and our rank, None when we do not count).
    """
    if not committed:
        count, rank = participating
        return BatchSlot(slot=-1 if rank is None else rank, participants=max(count, 1))
    count = result.replica_world_size if cap is None else min(cap, result.replica_world_size)
    return BatchSlot(slot=result.replica_rank, participants=max(count, 1))


def batch_claims(members: Sequence[QuorumMember]) -> dict[str, int | None]:
    """Each member's claimed batch slot (lighthouse.member_data.batch_slot_of), read once."""
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


def participation(
    result: QuorumResult, every_member_counts: bool, max_participants: int | None
) -> tuple[int, int | None]:
    """How many replicas count in this step's collectives, and our rank
    among them (None: we contribute zeros).

    Replicas at max_step count; every replica derives the same count from
    the quorum. One behind heals this step and contributes zeros (at
    max_step 0 the init_sync healing is applied before the forward pass, so
    those replicas count). `every_member_counts` (a synchronous quorum that
    may heal) counts every replica of the quorum, as in torchft: a replica
    that heals has its state before the forward pass. `max_participants`
    (WorldSizeMode.FIXED_WITH_SPARES: min_replica_size) caps the count; the
    replicas ranked past it are spares.
    """
    rank: int | None
    if every_member_counts:
        count, rank = result.replica_world_size, result.replica_rank
    else:
        count, rank = result.max_world_size, result.max_replica_rank
    if max_participants is not None:
        count = min(count, max_participants)
        if rank is not None and rank >= count:
            rank = None
    return count, rank


def heal_sources(result: QuorumResult, cap: int | None) -> list[tuple[int, str]]:
    """(replica rank, ManagerServer address) of the peers a healing rank
    fetches from: its primary alone, or with striping the first `cap` of
    `recover_src_*` (None: all), the primary first. A result without the
    list (from pytorch/torchft's ManagerServer) gives the primary alone.

    Raises:
        ValueError: `result` says we do not heal, or `cap` is below 1.
    """
    if not result.heal or result.recover_src_replica_rank is None:
        raise ValueError("heal_sources of a quorum result in which this rank does not heal")
    if cap is not None and cap < 1:
        raise ValueError(f"cap ({cap}) must be at least 1, or None for every source")
    primary = [(result.recover_src_replica_rank, result.recover_src_manager_address)]
    listed = list(zip(result.recover_src_replica_ranks, result.recover_src_manager_addresses))
    if len(listed) < 2 or listed[0] != primary[0]:
        return primary
    return listed[:cap] if cap is not None else listed


@dataclass(frozen=True)
class TransferPlan:
    """What one rank moves this step: whom it heals from, whom it serves."""

    sources: tuple[tuple[int, str], ...] = ()
    """(replica rank, ManagerServer address) to fetch from, the primary
    first; empty when this rank does not heal."""
    serve_to: tuple[int, ...] = ()
    """Replica ranks that fetch from this rank."""


def transfer_plan(result: QuorumResult, stripes: int | None) -> TransferPlan:
    """The one rule both ends of a heal follow, so they cannot disagree.

    `stripes` is how many sources a healer fetches from at once (None: all):
    1 for a transport that cannot stripe. With 1, a healer fetches from its
    primary alone and a source serves exactly the healers whose primary it
    is: a push transport (PGTransport) sends to them and to nobody else, so
    no send waits on a receiver that never comes. With more, every healer
    may fetch a stripe from every up-to-date rank, so a source serves them
    all; only a pull transport (a receiver asks for each range) stripes, so
    serving a healer whose cap leaves this source out costs nothing.

    Raises:
        ValueError: `stripes` is below 1.
    """
    if stripes is not None and stripes < 1:
        raise ValueError(f"stripes ({stripes}) must be at least 1, or None for every source")
    sources = tuple(heal_sources(result, stripes)) if result.heal else ()
    if stripes == 1 or not result.recover_stripe_dst_replica_ranks:
        return TransferPlan(sources, result.recover_dst_replica_ranks)
    return TransferPlan(sources, result.recover_stripe_dst_replica_ranks)


HEAL_SOURCES_ENV = "TORCHFT_HEAL_SOURCES"


def heal_sources_from_env(environ: Mapping[str, str]) -> int | None:
    """`Manager(heal_sources=...)` from TORCHFT_HEAL_SOURCES, for scripts
    that do not pass it: unset, empty or "all": every up-to-date peer
    (None); N >= 1: at most N (1: one peer, as torchft).

    Raises:
        ValueError: anything else, naming the variable and what it takes.
    """
    value = environ.get(HEAL_SOURCES_ENV, "").strip()
    if value.lower() in ("", "all"):
        return None
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(
            f"{HEAL_SOURCES_ENV}={value!r}: set it to how many up-to-date peers a healing "
            "rank fetches from at once, a number >= 1 (1: one peer, as torchft), or 'all'"
        )
    return cap
