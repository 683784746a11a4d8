"""Manager arguments shared by pytorch/torchft's Manager and ours, for the
tests that run one-rank replica groups of both in one job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore


def manager_kwargs(
    replica_id: str, lighthouse: str, store: TCPStore, min_replica_size: int, timeout: timedelta
) -> dict[str, Any]:
    """A synchronous-quorum group of one rank holding no state; every bound
    is `timeout`."""
    return dict(
        load_state_dict=lambda _: None,
        state_dict=lambda: {},
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname="127.0.0.1",
    )
