"""pytorch/torchft 0.2.0 (the release on the package index) and torchft_like
share a real allreduce: both rendezvous through the store prefix
`{store_address}/torchft/{quorum_id}/{group_rank}`, so a job can move from
one to the other a group at a time (docs/differences.md).

torchft 0.2.0 cannot be installed beside the nightly of the bench extra, so
this runs only where 0.2.x is the installed torchft (opt-in, `-m integration`):

    python3 -m venv /tmp/tf020
    /tmp/tf020/bin/pip install torch==2.13.0   # first, pinned: no CUDA build
    /tmp/tf020/bin/pip install torchft==0.2.0
    /tmp/tf020/bin/pip install -e '.[dev]'
    OMP_NUM_THREADS=1 /tmp/tf020/bin/python -m pytest -m integration \\
        tests/integration/test_torchft_020_mixed.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib import metadata
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._one_rank import manager_kwargs
from torchft_like import Manager, ProcessGroupGloo


def _torchft_version() -> str | None:
    for dist in ("torchft", "torchft-nightly"):  # the nightly installs as the latter
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            pass
    return None


VERSION = _torchft_version()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        VERSION is None or not VERSION.startswith("torchft 0.2."),
        reason=f"needs torchft 0.2.x installed (found {VERSION or 'none'}); see the docstring",
    ),
]
T = timedelta(seconds=10)
STEPS = 3


def group(kind: str, lighthouse: str) -> tuple[int, list[float]]:
    """One replica group of one rank: its committed steps and allreduced values."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    value = 1.0 if kind == "torchft" else 2.0
    kwargs = manager_kwargs(f"{kind}_group", lighthouse, store, 2, T)
    if kind == "torchft":
        from torchft.manager import Manager as TorchftManager
        from torchft.process_group import ProcessGroupGloo as TorchftGloo

        manager: Any = TorchftManager(pg=TorchftGloo(timeout=T), **kwargs)
    else:
        manager = Manager(pg=ProcessGroupGloo(timeout=T), exit_with_parent=False, **kwargs)
    values = []
    try:
        for _ in range(2 * STEPS):  # bounded: a step that cannot commit ends the test
            if manager.current_step() == STEPS:
                break
            manager.start_quorum()
            t = torch.tensor([value])
            manager.allreduce(t).wait()
            if manager.should_commit():
                values.append(t.item())
        return manager.current_step(), values
    finally:
        manager.shutdown()


def _lighthouse(kind: str) -> Any:
    if kind == "ours":
        return LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000)
    from torchft._torchft import LighthouseServer as TorchftLighthouse

    return TorchftLighthouse(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)


@pytest.mark.parametrize("lighthouse_kind", ["ours", "torchft"])
def test_a_torchft_020_group_and_a_torchft_like_group_allreduce_together(lighthouse_kind):
    lighthouse = _lighthouse(lighthouse_kind)
    try:
        with ThreadPoolExecutor(2) as pool:
            kinds = ["torchft", "torchft_like"]
            results = list(pool.map(group, kinds, [lighthouse.address()] * 2))
    finally:
        lighthouse.shutdown()
    for steps, values in results:
        assert steps == STEPS
        assert values == [1.5] * STEPS  # the average of 1 and 2: both groups took part
