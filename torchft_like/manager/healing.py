"""Receiving a healing rank's state from up-to-date peers, and the record of one heal.

Apart from rank.py (the Manager's step machine) because it is the one part of a step that talks to
other groups' checkpoint servers: ask every source for its checkpoint
metadata at once, hand them to the transport, and measure what the heal
cost (the metrics and the report the lighthouse's heal log gets). The
decisions are elsewhere: whether this step heals and from which peers is
settling's (heal_plan.transfer_plan), one stream or striped is
checkpointing.heal_source's, when the state is applied is rank's
(should_commit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from lighthouse.core.member_data import rank_heal_report
from lighthouse.core.views import QuorumResult
from lighthouse.rpc.tls import TLSConfig
from torchft_like.checkpointing import CheckpointTransport
from torchft_like.checkpointing.http_fetch import GONE_AFTER_S
from torchft_like.checkpointing.transport import capable
from torchft_like.manager.config import ManagerConfig
from torchft_like.manager.group.client import ManagerClientProtocol
from torchft_like.manager.heal_plan import TransferPlan


@dataclass(frozen=True)
class Heal:
    """One received state and what receiving it cost."""

    state: dict[str, Any]
    seconds: float
    num_bytes: int
    report: str
    """JSON sent with the next quorum request (lighthouse.core.heals)."""


def receive_state(
    transport: CheckpointTransport,
    result: QuorumResult,
    plan: TransferPlan,
    timeout: timedelta,
    metadata_of: Callable[[str], str],
    on_begun: Callable[[], None],
    log: logging.LoggerAdapter[logging.Logger],
) -> Heal:
    """Fetches the state at `result.max_step` from the plan's sources.

    `metadata_of(manager_address)` asks a source's ManagerServer how to
    reach its checkpoint server. `on_begun` is called once a one-source
    transfer has begun at the source (when the transport can say so);
    a striped heal, or a transport that cannot, calls it only after this
    returns (the caller does). One source or several is not decided here:
    a transport that can stripe gets every source that answered and applies
    `heal_source.heal_fetch`; one that cannot has a plan of one source.

    Raises:
        Exception: the transfer failed, or no source answered for its metadata.
    """
    start = time.monotonic()
    assert result.recover_src_replica_rank is not None, "healing without a source"
    sources = list(plan.sources)
    log.info(
        "healing from replica rank %d (%s) at step %d%s",
        result.recover_src_replica_rank,
        result.recover_src_manager_address,
        result.max_step,
        f", ranks {[r for r, _ in sources[1:]]} to stripe with" if len(sources) > 1 else "",
    )
    # Other transports (torchft's signature) cannot say when a transfer
    # began: their heal's collectives wait for all of it.
    begun: dict[str, Any] = {"on_begun": on_begun} if capable(transport, "reports_begun") else {}
    answered = _source_metadata(sources, metadata_of, log)
    if capable(transport, "can_stripe"):
        state = transport.recv_checkpoint_striped(answered, result.max_step, timeout, **begun)
    else:
        (rank, metadata), *_ = answered
        state = transport.recv_checkpoint(rank, metadata, result.max_step, timeout, **begun)
    took = time.monotonic() - start
    num_bytes = tensor_bytes(state)
    report = rank_heal_report(result.max_step, took, num_bytes, result.recover_src_manager_address)
    return Heal(state=state, seconds=took, num_bytes=num_bytes, report=report)


def ask_metadata(
    make_client: Callable[[str, timedelta, str | None, TLSConfig | None], ManagerClientProtocol],
    manager_address: str,
    group_rank: int,
    config: ManagerConfig,
    timeout: timedelta,
) -> str:
    """The checkpoint metadata of group rank `group_rank` of the source
    whose ManagerServer is at `manager_address`. `make_client` is the
    Manager's ManagerClient (so that tests patching it reach this call).

    The source asked for this quorum moments ago, so it was listening; one
    that refuses connections for a second (GONE_AFTER_S) has died since:
    fail the heal (the next quorum leaves it out) rather than wait the
    whole connect timeout.
    """
    connect = min(config.connect_timeout, timedelta(seconds=GONE_AFTER_S))
    src = make_client(manager_address, connect, config.secret, config.tls)
    try:
        return src.checkpoint_metadata(group_rank, timeout)
    finally:
        src.close()


def _source_metadata(
    sources: list[tuple[int, str]],
    metadata_of: Callable[[str], str],
    log: logging.LoggerAdapter[logging.Logger],
) -> list[tuple[int, str]]:
    """(replica rank, checkpoint metadata) of every source that answers,
    asked at once; a source that does not is left out (logged), and only
    when none answers does the heal fail."""
    if len(sources) == 1:  # no thread to ask one, and its error is the heal's as it is
        rank, address = sources[0]
        return [(rank, metadata_of(address))]
    with ThreadPoolExecutor(len(sources), thread_name_prefix="torchft_heal_metadata") as pool:
        futures = [pool.submit(metadata_of, address) for _, address in sources]
    found, errors = [], []
    for (rank, address), future in zip(sources, futures):
        try:
            found.append((rank, future.result()))
        except Exception as e:
            errors.append(e)
            log.warning(
                "healing without replica rank %d (%s): %s: %s", rank, address, type(e).__name__, e
            )
    if not found:
        raise errors[0]
    return found


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a state tree (dicts, lists, tuples), the size of a heal."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0
