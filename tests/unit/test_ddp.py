"""DistributedDataParallel with a Manager double (the only double in the suite:
these tests pin what DDP asks of the Manager, in one process, without peers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp

from torchft_like import BufferSync, DistributedDataParallel, PureDistributedDataParallel
from torchft_like._work import completed_work

pytestmark = pytest.mark.timeout(60)


class ManagerDouble:
    """Acts as if one more replica contributed zeros: SUM is the identity and
    AVG halves. Records every allreduce and runs commit hooks on demand."""

    def __init__(self, participating_rank: int | None = 0) -> None:
        self.sizes: list[int] = []
        self.ops: list[ReduceOp] = []
        self.hooks = []
        self._rank = participating_rank
        self.abandon = False
        """Leave every in-place allreduce to an abandoned collective (a member gone)."""
        self.left: list[torch.Tensor] = []
        """Tensors of abandoned collectives, which gloo may still write into."""

    def allreduce(self, tensor, reduce_op=ReduceOp.AVG, *, in_place=False):
        self.sizes.append(tensor.numel())
        self.ops.append(reduce_op)
        if self.abandon and in_place:
            self.left.append(tensor)
            return completed_work(tensor)
        if reduce_op == ReduceOp.AVG:
            tensor.div_(2)
        return completed_work(tensor)

    def abandoned(self) -> int:
        return len(self.left)

    def register_commit_hook(self, hook) -> None:
        self.hooks.append(hook)

    def commit(self) -> None:
        for hook in self.hooks:
            hook()

    def participating_rank(self):
        return self._rank

    def errored(self):
        return None


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def step(model: nn.Module, seed: int = 1) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def test_the_hook_is_called_per_bucket_and_gradients_are_the_average():
    manager = ManagerDouble()
    model = mlp()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.01)  # several buckets
    step(ddp)
    step(reference)
    assert len(manager.sizes) > 1, "expected one allreduce per bucket"
    assert sum(manager.sizes) == sum(p.numel() for p in model.parameters())
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad / 2)


def test_a_bucket_left_to_an_abandoned_allreduce_is_never_a_gradient_again():
    # Buckets are reduced in place (no private copy): after an abort, gloo may
    # still write into them when the gone member comes back. DDP must then
    # train on new buckets, or that late write lands in a live gradient.
    manager = ManagerDouble()
    model = mlp()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.01)
    step(ddp)
    manager.abandon = True
    step(ddp, 2)  # a member is gone: every bucket's allreduce is abandoned
    manager.abandon = False
    assert len(manager.left) > 1
    ddp.zero_grad(set_to_none=False)  # into the old buckets, as a user may
    step(ddp, 3)
    step(reference, 3)
    for t in manager.left:
        t.fill_(1e6)  # the gone member came back: the abandoned allreduces complete
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad / 2)
    old = {t.untyped_storage().data_ptr() for t in manager.left}
    assert not any(p.grad.untyped_storage().data_ptr() in old for p in model.parameters())
    # ...and the layout of the new buckets is the old one (every replica's must match).
    sizes = manager.sizes
    per_step = len(manager.left)
    assert sizes[-per_step:] == sizes[:per_step]


def test_bucket_layout_of_a_restarted_wrapper_matches_one_that_ran_for_a_while():
    running = ManagerDouble()
    ddp = DistributedDataParallel(running, mlp(), bucket_cap_mb=0.01)
    for seed in range(4):
        ddp.zero_grad()
        step(ddp, seed)
    per_step = len(running.sizes) // 4
    layouts = [running.sizes[i * per_step : (i + 1) * per_step] for i in range(4)]
    assert all(layout == layouts[0] for layout in layouts), "the layout changed after step 1"
    restarted = ManagerDouble()
    step(DistributedDataParallel(restarted, mlp(), bucket_cap_mb=0.01))
    assert restarted.sizes == layouts[-1]


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


@pytest.mark.parametrize(
    "policy, source, expected_mean",
    [
        (BufferSync.BROADCAST, True, lambda m: m),  # the source keeps its own
        (
            BufferSync.BROADCAST,
            False,
            lambda m: torch.zeros_like(m),
        ),  # others take the source's (here: 0)
        (BufferSync.AVERAGE, True, lambda m: m / 2),
        (BufferSync.NONE, False, lambda m: m),
    ],
)
def test_buffers_follow_the_chosen_policy(policy, source, expected_mean):
    manager = ManagerDouble(participating_rank=0 if source else 1)
    model = bn_model()
    ddp = DistributedDataParallel(
        manager,
        model,
        buffer_sync={
            "1.running_mean": policy,
            "1.running_var": policy,
            "1.num_batches_tracked": BufferSync.NONE,
        },
    )
    ddp(torch.randn(8, 4)).sum().backward()
    mean_after_forward = model[1].running_mean.clone()
    manager.commit()
    torch.testing.assert_close(model[1].running_mean, expected_mean(mean_after_forward))
    assert model[1].num_batches_tracked.item() == 1


def test_by_default_every_buffer_is_broadcast_from_the_source():
    manager = ManagerDouble(participating_rank=1)
    model = bn_model()
    ddp = DistributedDataParallel(manager, model)
    ddp(torch.randn(8, 4)).sum().backward()
    manager.commit()
    assert model[1].running_mean.abs().sum() == 0 and model[1].num_batches_tracked.item() == 0
    assert ReduceOp.SUM in manager.ops


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"process_group": None}, "does not take process_group"),
        ({"device_mesh": None}, "does not take device_mesh"),
        ({"buffer_sync": {"nope": BufferSync.NONE}}, r"unknown buffers \['nope'\]"),
        ({"buffer_sync": {"1.num_batches_tracked": BufferSync.AVERAGE}}, "cannot be averaged"),
    ],
)
def test_kwargs_that_break_the_guarantees_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallel(ManagerDouble(), bn_model(), **kwargs)


class Branchy(nn.Module):
    """A trunk, a branch used only when asked, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.trunk(x).relu()
        if use_branch:
            h = h + self.branch(h).relu()
        return self.head(h)


def test_find_unused_parameters_sums_the_used_map_through_the_manager():
    manager = ManagerDouble()
    model = Branchy()
    ddp = DistributedDataParallel(manager, model, find_unused_parameters=True)
    ddp(torch.randn(4, 8), use_branch=False).sum().backward()
    num_params = len(list(model.parameters()))
    # The last allreduce is DDP's used map: one int per parameter, SUM.
    assert manager.sizes[-1] == num_params and manager.ops[-1] == ReduceOp.SUM
    # The double adds nothing, so the branch is unused everywhere: untouched.
    assert model.branch.weight.grad is None and model.trunk.weight.grad is not None
    ddp(torch.randn(4, 8), use_branch=True).sum().backward()
    assert model.branch.weight.grad is not None


def test_static_graph_issues_the_same_allreduces_in_a_first_step_as_later():
    # A restarted replica takes its first step next to others that do not:
    # the collectives must match, so static_graph's first-step map stays local.
    manager = ManagerDouble()
    ddp = DistributedDataParallel(manager, mlp(), static_graph=True, bucket_cap_mb=0.01)
    per_step = []
    for seed in range(3):
        step(ddp, seed)
        per_step.append((manager.sizes[:], manager.ops[:]))
        manager.sizes.clear()
        manager.ops.clear()
    assert len(per_step[0][0]) > 1 and per_step[0] == per_step[1] == per_step[2]
    assert set(per_step[0][1]) == {ReduceOp.AVG}


def test_a_module_on_several_devices_is_refused():
    model = bn_model()
    model[2].to(torch.float64)  # same device: fine
    DistributedDataParallel(ManagerDouble(), model)
    meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        DistributedDataParallel(ManagerDouble(), meta)


def test_pure_ddp_allreduces_each_gradient_once():
    manager = ManagerDouble()
    model = mlp()
    reference = copy.deepcopy(model)
    step(PureDistributedDataParallel(manager, model))
    step(reference)
    assert len(manager.sizes) == len(list(model.parameters()))
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad / 2)
