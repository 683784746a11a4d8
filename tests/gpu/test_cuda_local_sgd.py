"""DiLoCo on CUDA: the side stream of each fragment carries the averaging,
and the training stream waits for it. With an averaging that runs late (a
sleep kernel first) and changes the values (it halves them, as averaging
with a peer whose pseudo-gradient is zero would), the result must be bit
for bit the one of the same run with no side stream."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from torchft_like import local_sgd
from torchft_like.local_sgd import DiLoCo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]
GPU = torch.device("cuda", 0)


class _Done:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(tensor)

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class _Manager:
    """One group alone, its allreduce late on the caller's stream."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(use_async_quorum=False)
        self.step = 0
        self.state_fns: dict[str, Any] = {}

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.state_fns[key] = (load, save)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _Done:
        torch.cuda._sleep(20_000_000)
        tensor.mul_(0.5)
        return _Done(tensor)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None: ...
    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...
    def is_serving_state(self) -> bool:
        return False


def train(
    streams: bool, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    if not streams:
        monkeypatch.setattr(local_sgd, "side_stream", lambda module: None)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).to(GPU)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((torch.rand(p.shape, generator=g) - 0.5).to(GPU))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    frags = [model[0], model[2]]
    outers: list[torch.optim.Optimizer] = [
        torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in frags
    ]
    manager = _Manager()
    with DiLoCo(manager, frags, inner, outers, sync_every=4, **kwargs):
        for step in range(16):
            gx = torch.Generator().manual_seed(step)
            x = torch.randn(32, 64, generator=gx).to(GPU)
            inner.zero_grad()
            model(x).square().mean().backward()
            inner.step()
    backup = manager.state_fns["StreamingDiLoCoFragment_0"][1]()["original_parameters"]
    monkeypatch.undo()
    return [p.detach().cpu() for p in model.parameters()], backup


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"fragment_sync_delay": 1}, {"use_bucketization": True, "bucket_cap_mb": 0.01}],
    ids=["plain", "delay1", "buckets"],
)
def test_the_side_stream_gives_the_same_bits_as_none(kwargs, monkeypatch) -> None:
    with_streams, backup = train(True, monkeypatch, **kwargs)
    without, backup_without = train(False, monkeypatch, **kwargs)
    for a, b in zip(with_streams, without, strict=True):
        assert torch.equal(a, b)
    for name in backup:
        assert torch.equal(backup[name], backup_without[name]), name


def test_a_fragment_on_cuda_gets_a_side_stream_and_one_on_cpu_none() -> None:
    assert local_sgd.side_stream(nn.Linear(2, 2).to(GPU)) is not None
    assert local_sgd.side_stream(nn.Linear(2, 2)) is None
