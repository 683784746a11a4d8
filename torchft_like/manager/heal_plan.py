"""A rank's heal plan: whether and where it counts in a quorum, whom it heals
from and whom it serves.

Both ends of a heal derive their part from the same quorum result (each
group rank's share, lighthouse.core.views) with these rules, so that a
source and its healers cannot disagree. Pure, and the Manager's alone:
settling applies it, healing carries it out, config reads its variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lighthouse.core.views import QuorumResult

__all__ = [
    "HEAL_SOURCES_ENV",
    "TransferPlan",
    "heal_sources",
    "heal_sources_from_env",
    "participation",
    "transfer_plan",
]


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
