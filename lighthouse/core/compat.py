"""Which replica groups of a mixed-version job can share an allreduce: pure.

pytorch/torchft's nightly releases (2026.10 on) form their cross-group
process groups from reconfigure handles exchanged in the quorum
(`QuorumMember` field 9, `repeated string reconfigure_handles`, one per group
rank); torchft_like and torchft 0.2.0 rendezvous through a store prefix
derived from the quorum id. A quorum mixing the two stalls: each side's
process group configure waits for peers that rendezvous elsewhere. The
lighthouse (lighthouse.core.quorum.compute_quorum) and, under torchft's own
lighthouse, our ManagerServer ask `refusals` which members to leave out,
and tell those why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lighthouse.core.member_data import LOCAL_RENDEZVOUS, is_local_rendezvous
from lighthouse.core.members import QuorumMember

HANDLES = "handles"
"""Rendezvous through reconfigure handles carried in the quorum (torchft nightly)."""
STORE = "store"
"""Rendezvous through a store prefix from the quorum id (torchft_like, torchft 0.2.0)."""
LOCAL = LOCAL_RENDEZVOUS
"""A group whose process group never talks to other groups (ProcessGroupDummy):
compatible with either side, so mixed jobs can still heal from each other.
Such a group says so in its QuorumMember.data (lighthouse.core.member_data)."""

HANDLES_FIELD = 9
"""QuorumMember's field number of torchft's `reconfigure_handles`."""

_SPEAKERS = {
    HANDLES: "torchft's reconfigure-handle rendezvous (pytorch/torchft nightly >= 2026.10)",
    STORE: "store rendezvous (torchft_like 0.1.0, pytorch/torchft <= 0.2.0)",
}


def field_numbers(raw: bytes) -> set[int]:
    """The top-level field numbers of serialized protobuf fields.

    Reads only tags and lengths; stops at the first malformed byte, so a
    garbled tail yields the fields before it rather than an error.
    """
    found: set[int] = set()
    pos, end = 0, len(raw)

    def varint() -> int | None:
        nonlocal pos
        value, shift = 0, 0
        while pos < end and shift < 64:
            byte = raw[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        return None

    while pos < end:
        tag = varint()
        if tag is None or tag >> 3 == 0:
            break
        wire_type = tag & 7
        if wire_type == 0:
            if varint() is None:
                break
        elif wire_type == 1:
            pos += 8
        elif wire_type == 2:
            size = varint()
            if size is None:
                break
            pos += size
        elif wire_type == 5:
            pos += 4
        else:  # groups (3, 4) are not used by proto3 senders
            break
        if pos > end:
            break
        found.add(tag >> 3)
    return found


def rendezvous_of(member: QuorumMember) -> str:
    """HANDLES, STORE or LOCAL (see the constants) for one member."""
    if member.unknown_fields and HANDLES_FIELD in field_numbers(member.unknown_fields):
        return HANDLES
    return LOCAL if is_local_rendezvous(member.data) else STORE


def kept_rendezvous(kinds: Mapping[str, str], prev_members: Iterable[str]) -> str:
    """The rendezvous a mixed job keeps: the one every member of the previous
    quorum speaks (a training job is not interrupted by a newcomer), else the
    one most members speak, else (a tie) STORE, which every release but the
    nightly speaks. `kinds` holds no LOCAL member."""
    held = {kinds[rid] for rid in prev_members if rid in kinds}
    if len(held) == 1:
        return held.pop()
    num_handles = sum(1 for kind in kinds.values() if kind == HANDLES)
    return HANDLES if num_handles > len(kinds) - num_handles else STORE


def training_members(members: Iterable[QuorumMember]) -> tuple[str, ...]:
    """The members at the furthest step, when it is past 0: the side already
    training, for a caller that has no previous quorum of its own (our
    ManagerServer's first quorum under torchft's lighthouse)."""
    listed = list(members)
    top = max((m.step for m in listed), default=0)
    return tuple(m.replica_id for m in listed if m.step == top) if top > 0 else ()


def refusals(members: Mapping[str, QuorumMember], prev_members: Iterable[str]) -> dict[str, str]:
    """Members that cannot share an allreduce with the rest -> why, in words.

    Args:
        members: replica_id -> the latest self-description of each live
            replica (waiting or not: a live replica of the other side
            still counts, so the job does not flip sides each step).
        prev_members: the replica ids of the previous quorum.

    Returns:
        Empty when every member can rendezvous with the others (the usual
        case); else the members of the side not kept, each with the error
        its Quorum call gets: both versions and what to do.
    """
    kinds = {}
    for rid, member in members.items():
        kind = rendezvous_of(member)
        if kind != LOCAL:
            kinds[rid] = kind
    if len(set(kinds.values())) <= 1:
        return {}
    keep = kept_rendezvous(kinds, prev_members)
    kept = sorted(rid for rid, kind in kinds.items() if kind == keep)
    shown = ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else "")
    return {
        rid: (
            f"replica {rid} speaks {_SPEAKERS[kind]} but this job's members "
            f"({len(kept)}: {shown}) use {_SPEAKERS[keep]}: their process groups cannot "
            "allreduce together, so it is left out of the quorum. Run every replica group "
            "of a job on one of the two (pin one torchft version, or torchft_like), or "
            f"restart it once those groups have stopped (docs/differences.md)"
        )
        for rid, kind in sorted(kinds.items())
        if kind != keep
    }
