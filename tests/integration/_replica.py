"""A small replica (MLP + AdamW + Manager) on a real lighthouse, for the
integration tests that run replica groups as threads in one process."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch import nn, optim
from torch.distributed import TCPStore

from torchft_like import Manager, ProcessGroupGloo

TIMEOUT = timedelta(seconds=10)


def small_replica(
    group: int,
    rank: int,
    group_world_size: int,
    store: TCPStore,
    lighthouse_addr: str,
    model: nn.Module,
    inner: optim.Optimizer,
    pg: Any = None,
    **manager_kwargs: Any,
) -> Manager:
    """The Manager of rank `rank` of replica group `group`, healing `model`
    and `inner` as {"m": ..., "o": ...}; `manager_kwargs` override the rest."""
    kwargs: dict[str, Any] = {
        "min_replica_size": 1,
        "timeout": TIMEOUT,
        "quorum_timeout": timedelta(seconds=30),
        "connect_timeout": TIMEOUT,
        **manager_kwargs,
    }
    return Manager(
        pg=pg if pg is not None else ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        rank=rank,
        world_size=group_world_size,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"group{group}",
        hostname="127.0.0.1",
        **kwargs,
    )
