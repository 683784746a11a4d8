"""FT-HSDP healing state in one process (a gloo world of one rank): a shard of
the same layout loads bit-identical; a shard of another group size, shard
placement or model shape is refused with a ValueError naming the difference.
The 2x2 multi-process run is tests/e2e/test_hsdp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchft_like.hsdp import HSDPState
from torchft_like.process_group import ManagedProcessGroup

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _NoQuorumYet:
    """A Manager before its first start_quorum (the real one's state then)."""

    _quorum_future = None

    def num_participants(self) -> int:
        raise AssertionError("call start_quorum() first")

    participating_rank = num_participants


def _trained(hidden: int = 6, shard_dim: int = 0, seed: int = 0):  # noqa: ANN202
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from torchft_like.device_mesh import managed_device_mesh

    replicate = ManagedProcessGroup(_NoQuorumYet()).register("dp_replicate")
    from torch.distributed.device_mesh import init_device_mesh

    inner = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    mesh = managed_device_mesh(replicate, inner, 0, "dp_replicate")
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(min(shard_dim, p.dim() - 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    # One local step (no backward: its reduction would ask the Manager).
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return HSDPState(model, optimizer)


def _wire(state: dict) -> dict:
    """`state` as a healing rank receives it: header and shard bytes only
    (each DTensor rebuilt around its local shard on a described mesh)."""
    from torchft_like.checkpointing import state_format

    tree, tensors = state_format.flatten(state)
    header = state_format.decode_header(
        state_format.encode_header(1, tree, "crc32c")[state_format.PREFIX.size :]
    )
    received = [state_format.empty(spec) for spec in header.specs]
    for got, sent in zip(received, tensors, strict=True):
        got.view(-1).copy_(sent.reshape(-1))
    return state_format.unflatten(header.tree, received)


def _local(state: HSDPState) -> list[torch.Tensor]:
    return [t.to_local() for t in state.model.state_dict().values()] + [
        v.to_local() if hasattr(v, "to_local") else v
        for s in state.optimizer.state_dict()["state"].values()
        for v in s.values()
    ]


def test_the_replicate_group_is_alone_before_the_first_quorum_and_found_by_name(world):
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = ManagedProcessGroup(_NoQuorumYet()).register("dp_replicate")
    assert (pg.size(), pg.rank()) == (1, 0)
    assert _resolve_process_group(pg.group_name) is pg
    pg.unregister()


def test_a_shard_of_the_same_layout_loads_bit_identical(world):
    source, receiver = _trained(seed=0), _trained(seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(_local(source), _local(receiver)))
    receiver.load_state_dict(_wire(source.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(_local(source), _local(receiver), strict=True))


def test_a_group_of_another_size_is_refused(world):
    state = _trained().state_dict()
    state["layout"]["group_size"] = 3  # what a live group of 3 ranks sends
    with pytest.raises(ValueError, match=r"live replica groups have 3 ranks, this group has 1"):
        _trained().load_state_dict(_wire(state))


@pytest.mark.parametrize(
    ("theirs", "match"),
    [({"shard_dim": 1}, r"at 0\.weight: .*Shard\(dim=1\)"), ({"hidden": 7}, r"at 0\.weight")],
)
def test_a_group_that_shards_another_way_is_refused(world, theirs, match):
    before = _local(receiver := _trained())
    with pytest.raises(ValueError, match=f"shard layout mismatch {match}"):
        receiver.load_state_dict(_wire(_trained(**theirs).state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(before, _local(receiver)))  # nothing half-loaded
