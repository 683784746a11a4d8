"""A one-rank replica group's Manager with no model, for control-plane benchmarks."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def one_rank_manager(ft: Any, lighthouse: str, group: int, **extra: Any) -> tuple[Any, Any]:
    """(its store, the Manager) of replica group `bench{group}`: one rank,
    its own TCPStore, gloo, no state (init_sync off: nothing to sync, and no
    allreduce to fence a transfer). `ft` is torchft_like or torchft; keep
    the store alive as long as the Manager."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench{group}",
        hostname="127.0.0.1",
        init_sync=False,
        **extra,
    )
    return store, manager
