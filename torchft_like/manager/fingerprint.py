"""A cheap fingerprint of a replica's state, to find replicas that diverged.

Replicas at the same committed step must hold bit-identical state (docs/architecture.md,
"Invariants"). Comparing a short fingerprint every few steps catches the ones
that do not (a flipped bit, a non-deterministic kernel, a bad host) before
they train further on wrong weights.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def fingerprint(state: Any) -> str:
    """16 hex digits, equal for bit-identical states.

    Walks nested mappings, lists, tuples and iterators (mapping keys sorted, so the
    insertion order of e.g. an optimizer's state does not matter) and hashes
    each tensor's path, dtype, shape and a CRC-32 of its raw bytes; plain
    scalars (int, float, bool, str, None) are hashed by value, other objects
    are skipped. CRC-32 of the raw bytes, not a float sum: it is exact (no
    rounding, no dependence on the reduction order or thread count), sees
    swapped elements, and zlib runs it at memory speed without holding the
    GIL. Two different states collide with probability about 2**-32 per
    differing tensor.
    """
    digest = hashlib.blake2b(digest_size=8)
    _update(digest, "", state)
    return digest.hexdigest()


def step_fingerprint(
    step: int,
    interval: int | None,
    read_allowed: bool,
    state: Callable[[], Any],
    log: logging.LoggerAdapter[logging.Logger],
) -> str:
    """The fingerprint of `state()` for this step's quorum to carry to the
    other replicas, every `interval` committed steps; "" on other steps,
    while the state is being written (`read_allowed` False: compare another
    step), or when taking it fails (logged). The Manager takes it when its
    step begins, because the state is final then (the optimizer stepped
    after the last commit; this step's forward pass, which may update
    buffers, has not begun). Each rank sends its own: ranks of one group
    need not hold the same state, and rank r is compared with rank r of the
    other groups."""
    if interval is None or step == 0 or step % interval:
        return ""
    if not read_allowed:
        return ""
    try:
        value = fingerprint(state())
    except Exception as e:
        log.exception("fingerprint failed, not comparing this step: %s", e)
        return ""
    log.debug("state fingerprint %s", value)
    return value


def _update(digest: Any, path: str, value: Any) -> None:
    if isinstance(value, DTensor):
        # FSDP/HSDP state: this rank's shard, compared with the same rank of
        # the other groups (a full tensor would be a collective in a read).
        _update(digest, f"{path}@{value.placements}", value.to_local())
    elif isinstance(value, torch.Tensor):
        data = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        crc = zlib.crc32(data.data)
        digest.update(f"{path}:{value.dtype}:{tuple(value.shape)}:{crc};".encode())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            _update(digest, f"{path}.{key!r}", value[key])
    elif isinstance(value, (list, tuple, Iterator)):  # e.g. model.parameters()
        for i, item in enumerate(value):
            _update(digest, f"{path}[{i}]", item)
    elif value is None or isinstance(value, (int, float, bool, str)):
        digest.update(f"{path}={value!r};".encode())
