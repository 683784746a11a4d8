"""pytorch/torchft's own Manager (the installed release, which exchanges
`QuorumMember.reconfigure_handles` through the lighthouse) commits steps
through our LighthouseServer: the fields we do not know travel unchanged."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._one_rank import manager_kwargs

torchft = pytest.importorskip("torchft")
torchft_manager = pytest.importorskip("torchft.manager")
torchft_pg = pytest.importorskip("torchft.process_group")

pytestmark = pytest.mark.timeout(90)
STEPS = 3
T = timedelta(seconds=10)


def torchft_group(group: int, lighthouse: str) -> tuple[int, list[float]]:
    """One torchft replica group of one rank; its steps and allreduced values."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if not hasattr(torchft_pg.ProcessGroup, "get_reconfigure_handle"):
        pytest.skip("this torchft release has no reconfigure handles")
    manager = torchft_manager.Manager(
        pg=torchft_pg.ProcessGroupGloo(timeout=T),
        **manager_kwargs(f"torchft_group{group}", lighthouse, store, 2, T),
    )
    values = []
    try:
        for _ in range(2 * STEPS):  # bounded: a step that cannot commit ends the test
            if manager.current_step() == STEPS:
                break
            manager.start_quorum()
            t = torch.tensor([float(group + 1)])
            manager.allreduce(t).wait()
            if manager.should_commit():
                values.append(t.item())
        return manager.current_step(), values
    finally:
        manager.shutdown()


def test_torchft_managers_of_the_newest_release_commit_through_our_lighthouse():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(torchft_group, range(2), [lighthouse.address()] * 2))
    finally:
        lighthouse.shutdown()
    for steps, values in results:
        assert steps == STEPS
        assert values == [1.5] * STEPS  # the average of 1 and 2: both groups took part
