"""The keys of `QuorumMember.data` and their JSON: what a replica group shares
with the others (and the lighthouse) through the quorum.

`data` is free-form JSON text that the lighthouse passes on unchanged; a
pytorch/torchft peer sends "" or whatever its user put there, and reads ours
as one dict. A torchft_like group's data is one JSON object with up to four
keys, in this order:

- `"fingerprint"`: `{"step": s, "values": [one per group rank]}`, the ranks'
  state fingerprints after `s` commits ("" for a rank that sent none), for
  the divergence check (lighthouse.core.views.find_divergence);
- `"heal"`: `{"step", "seconds", "bytes", "sources"}`, the group's last heal,
  merged from its ranks' reports, for the status page (lighthouse.core.heals);
- `"rendezvous"`: `"local"` when the group's process group never talks to
  other groups, for the mixed-version check (lighthouse.core.compat);
- `"slot"`: the participating rank the group predicted when it took its
  batch (-1: none), for the exactly-once data check
  (lighthouse.core.views.batch_slots_wrong).

One module owns them because both sides read and write them: the library's
group rule writes, the library's recovery and the lighthouse read, and the
lighthouse imports nothing of the library. Readers are lenient: a key that is
missing, malformed or from another step reads as absent, never as an error,
since a peer is free to put anything in `data`.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FINGERPRINT_KEY = "fingerprint"
"""Key of the ranks' state fingerprints: {"step": s, "values": [str per group rank]}."""
HEAL_KEY = "heal"
"""Key of the group's last heal: {"step", "seconds", "bytes", "sources"}."""
RENDEZVOUS_KEY = "rendezvous"
"""Key by which a group says how its process group meets others' (only LOCAL_RENDEZVOUS)."""
LOCAL_RENDEZVOUS = "local"
SLOT_KEY = "slot"
"""Key of the participating rank a group's ranks predicted when they took
their batch (an int; -1: they could not predict, or their ranks differ)."""
"""RENDEZVOUS_KEY's value for a group whose process group never talks to other
groups (ProcessGroupDummy)."""

MemberData = str | Mapping[str, Any] | None
"""`QuorumMember.data` as it may come: JSON text, already decoded (a
pytorch/torchft client's API takes and gives a dict), or None."""


@dataclass(frozen=True)
class HealReport:
    """What a group says of its last heal (all ranks together)."""

    step: int
    """The step whose state it copied (the quorum's max step)."""
    seconds: float
    """The slowest rank's time from the quorum's answer to the state received."""
    num_bytes: int
    """Tensor bytes received, summed over the group's ranks."""
    sources: tuple[str, ...] = ()
    """ManagerServer addresses the ranks copied from."""


# --- writing ---------------------------------------------------------------


def fingerprint_entry(
    step: int, values: Mapping[int, str], world_size: int
) -> dict[str, dict[str, object]]:
    """The group's fingerprint entry: its ranks' fingerprints of their state
    after `step` commits ("" for a rank that sent none); an empty dict when
    no rank sent one."""
    if not any(values.values()):
        return {}
    listed = [values.get(rank, "") for rank in range(world_size)]
    return {FINGERPRINT_KEY: {"step": step, "values": listed}}


def rank_heal_report(step: int, seconds: float, num_bytes: int, source: str) -> str:
    """One rank's heal report, the JSON it sends in
    `ManagerQuorumRequest.heal_report` the step after it healed: the step
    whose state it copied, the seconds it took (to 0.1 ms), the tensor bytes
    received and the ManagerServer address it copied from."""
    return json.dumps(
        {"step": step, "seconds": round(seconds, 4), "bytes": num_bytes, "source": source}
    )


def merge_rank_heal_reports(reports: Iterable[str]) -> dict[str, Any] | None:
    """The group's heal entry from its ranks' reports (rank_heal_report),
    or None when none reads. Empty reports are skipped, unreadable ones too:
    a report is an aid, never a reason to fail a quorum. Ranks that healed
    to different steps: the latest step wins; its slowest rank's seconds,
    the sum of its ranks' bytes and their sources, sorted."""
    parsed: list[dict[str, Any]] = []
    for text in reports:
        if not text:
            continue
        try:
            value = json.loads(text)
            parsed.append(
                {
                    "step": int(value["step"]),
                    "seconds": float(value["seconds"]),
                    "bytes": int(value["bytes"]),
                    "source": str(value.get("source", "")),
                }
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    if not parsed:
        return None
    step = max(r["step"] for r in parsed)
    same = [r for r in parsed if r["step"] == step]
    return {
        "step": step,
        "seconds": max(r["seconds"] for r in same),
        "bytes": sum(r["bytes"] for r in same),
        "sources": sorted({r["source"] for r in same if r["source"]}),
    }


def group_data(
    *,
    step: int,
    fingerprints: Mapping[int, str],
    world_size: int,
    heal_reports: Iterable[str] = (),
    local_rendezvous: bool = False,
    batch_slot: int | None = None,
) -> str:
    """A group's `QuorumMember.data`: the JSON of its entries (fingerprints
    taken at `step`, the merged heal reports, the LOCAL_RENDEZVOUS mark, the
    batch slot), or
    "" when it has none, as a pytorch/torchft group sends."""
    entries: dict[str, object] = dict(fingerprint_entry(step, fingerprints, world_size))
    heal = merge_rank_heal_reports(heal_reports)
    if heal is not None:
        entries[HEAL_KEY] = heal
    if local_rendezvous:
        entries[RENDEZVOUS_KEY] = LOCAL_RENDEZVOUS
    if batch_slot is not None:
        entries[SLOT_KEY] = batch_slot
    return json.dumps(entries) if entries else ""


# --- reading ---------------------------------------------------------------


def _decoded(data: MemberData) -> Any:
    """`data` as JSON values (raises ValueError for text that is not JSON)."""
    return json.loads(data) if isinstance(data, str) else data


def fingerprint_of(data: MemberData, step: int, group_rank: int) -> str | None:
    """The fingerprint `data` holds for `group_rank`, taken at `step`.

    None when there is none: data empty, not ours, or taken at another step,
    so a fingerprint is only ever compared with one of the same step.
    """
    if not data:  # what most members send: no JSON to parse, no error to raise
        return None
    try:
        entry = _decoded(data)[FINGERPRINT_KEY]
        value = entry["values"][group_rank]
        if entry["step"] == step and isinstance(value, str) and value:
            return value
    except (ValueError, TypeError, KeyError, IndexError):
        pass
    return None


def heal_report_of(data: MemberData) -> HealReport | None:
    """The group's heal report in `data`, or None (none, or not ours)."""
    if not data:
        return None
    try:
        entry = _decoded(data)[HEAL_KEY]
        return HealReport(
            step=int(entry["step"]),
            seconds=float(entry["seconds"]),
            num_bytes=int(entry["bytes"]),
            sources=tuple(str(s) for s in entry.get("sources", ())),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def is_local_rendezvous(data: MemberData) -> bool:
    """Whether `data` marks the group LOCAL_RENDEZVOUS. Asked of every member
    on every quorum tick, so text without the key is not parsed."""
    if isinstance(data, str):
        if RENDEZVOUS_KEY not in data:  # the usual case: no JSON to parse
            return False
        try:
            data = json.loads(data)
        except ValueError:
            return False
    return isinstance(data, Mapping) and data.get(RENDEZVOUS_KEY) == LOCAL_RENDEZVOUS


def batch_slot_of(data: MemberData) -> int | None:
    """The batch slot `data` claims (SLOT_KEY), or None: no claim, or not
    ours. Asked of every member on every quorum, so text without the key
    is not parsed."""
    if isinstance(data, str):
        if SLOT_KEY not in data:
            return None
        try:
            data = json.loads(data)
        except ValueError:
            return None
    if not isinstance(data, Mapping):
        return None
    slot = data.get(SLOT_KEY)
    return slot if isinstance(slot, int) and not isinstance(slot, bool) else None
