"""Durable checkpoints on disk: names, completeness and retention. Pure:
directory listings in, decisions out.

Layout under the checkpoint directory: `step_{N:09d}/rank_{r}/` holds group
rank r's state at committed step N, written into a temporary directory and
renamed into place once its COMPLETE marker is written, so a crash mid-write
leaves only a temporary directory that no reader takes. Step N is usable once
every group rank has its own part there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

COMPLETE = "COMPLETE"
"""Marker file written last in a rank's part, before the rename."""
TMP_PREFIX = ".tmp-"

_STEP = re.compile(r"^step_(\d{9})$")
_RANK = re.compile(r"^rank_(\d+)$")


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def rank_dir(rank: int) -> str:
    return f"rank_{rank}"


def parse_step(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def complete_ranks(rank_listing: Mapping[str, Iterable[str]]) -> set[int]:
    """Ranks whose part is complete, from {rank dir name: its file names}."""
    ranks = set()
    for name, files in rank_listing.items():
        match = _RANK.match(name)
        if match and COMPLETE in set(files):
            ranks.add(int(match.group(1)))
    return ranks


def newest_complete(steps: Mapping[int, set[int]], world_size: int) -> int | None:
    """The newest step every rank 0..world_size-1 completed, or None.

    Args:
        steps: {step: ranks complete at that step}.
        world_size: ranks per replica group.
    """
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be at least 1")
    needed = set(range(world_size))
    done = [step for step, ranks in steps.items() if needed <= ranks]
    return max(done, default=None)


def steps_to_prune(steps: Mapping[int, set[int]], rank: int, keep: int) -> list[int]:
    """Steps whose part of `rank` goes: all but the newest `keep` steps that
    this rank completed, and older unfinished ones (a newer complete one
    replaces them). A rank prunes only its own parts, so ranks never race."""
    if keep < 1:
        raise ValueError(f"keep ({keep}) must be at least 1: the newest checkpoint stays")
    mine = sorted((s for s, ranks in steps.items() if rank in ranks), reverse=True)
    kept = set(mine[:keep])
    oldest_kept = min(kept, default=None)
    if oldest_kept is None:
        return []
    return sorted(s for s in steps if s not in kept and s < oldest_kept)
