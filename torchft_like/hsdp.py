"""The healing state of one FT-HSDP rank: its shard of the model and optimizer.

Rank r of every replica group holds the same shard (the same rows of each
parameter, and the optimizer state of those rows), so a restarted group's
rank r heals from rank r of a live group and moves only that shard: the
state below holds DTensors, and the checkpoint transports send a DTensor's
local shard plus its layout.

Loading checks that the sender shards the model the way this rank does (the
same group size, placements and shapes); a group that does not is refused
with a ValueError that names the difference, since copying a shard of
another layout would silently train on wrong weights.

    state = HSDPState(model, optimizer)
    manager.set_state_dict_fns(state.load_state_dict, state.state_dict)

On GPUs (`init_group_process_group`): FSDP2's all-gathers and
reduce-scatters inside a group run on NCCL, one GPU per rank; the
replicate dimension across groups goes through the Manager's own process
group (gloo on CUDA, or NCCL with a GPU per group), so only it is fault
tolerant. A received shard is put on this rank's parameters' device.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def group_backend(device: torch.device | str) -> str:
    """The backend of a replica group's own process group (FSDP's shard
    dimension): NCCL for CUDA, whose collectives stay on the GPU; gloo for
    the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group_process_group(
    device: torch.device | str | None = None, **kwargs: Any
) -> torch.device:
    """Starts this replica group's own default process group (torchrun's
    environment) on `device` and returns the device.

    Args:
        device: None: cuda:(LOCAL_RANK % GPUs) where CUDA is available, else
            the CPU. A CUDA device is made current and the NCCL group is
            bound to it (`device_id`), so its communicator is made at once.
        kwargs: passed to `torch.distributed.init_process_group` (timeout, ...).
    """
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", 0))
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(group_backend(device), device_id=device, **kwargs)
    else:
        dist.init_process_group(group_backend(device), **kwargs)
    return device


def _placements(t: DTensor) -> list[str]:
    return [repr(p) for p in t.placements]


def _layout(model_state: dict[str, Any]) -> dict[str, Any]:
    """What must agree between a sender and a receiver of a shard."""
    tensors: dict[str, Any] = {}
    for name, value in model_state.items():
        if isinstance(value, DTensor):
            tensors[name] = {
                "shape": list(value.shape),
                "local_shape": list(value.to_local().shape),
                "placements": _placements(value),
                "mesh_shape": list(value.device_mesh.shape),
            }
        elif isinstance(value, torch.Tensor):
            tensors[name] = {"shape": list(value.shape)}
    return {
        "group_size": dist.get_world_size() if dist.is_initialized() else 1,
        "shard_rank": dist.get_rank() if dist.is_initialized() else 0,
        "tensors": tensors,
    }


def _check_layout(ours: dict[str, Any], theirs: Any) -> None:
    advice = (
        "every replica group of an FT-HSDP job must have the same number of ranks and shard "
        "the same model the same way (mesh shape, placements); start this group like the others"
    )
    if not isinstance(theirs, dict) or set(theirs) != {"group_size", "shard_rank", "tensors"}:
        raise ValueError(
            f"the live replica group sent no FT-HSDP layout (got {theirs!r:.80}); {advice}"
        )
    if theirs["group_size"] != ours["group_size"]:
        raise ValueError(
            f"shard layout mismatch: the live replica groups have {theirs['group_size']} ranks, "
            f"this group has {ours['group_size']}; {advice}"
        )
    if theirs["shard_rank"] != ours["shard_rank"]:
        raise ValueError(
            f"shard layout mismatch: rank {ours['shard_rank']} received the shard of rank "
            f"{theirs['shard_rank']}; {advice}"
        )
    if set(theirs["tensors"]) != set(ours["tensors"]):
        missing = sorted(set(ours["tensors"]) - set(theirs["tensors"]))[:3]
        extra = sorted(set(theirs["tensors"]) - set(ours["tensors"]))[:3]
        raise ValueError(
            f"shard layout mismatch: the live groups' model lacks {missing} and has {extra}; "
            f"{advice}"
        )
    for name, mine in ours["tensors"].items():
        if theirs["tensors"][name] != mine:
            raise ValueError(
                f"shard layout mismatch at {name}: the live groups have {theirs['tensors'][name]}, "
                f"this group has {mine}; {advice}"
            )


def _onto(received: Any, target: torch.Tensor, what: str) -> Any:
    """`received`'s local shard as a DTensor on `target`'s own mesh (the
    received one is only a description of the sender's)."""
    if not isinstance(target, DTensor):
        return received
    if not isinstance(received, DTensor):
        raise ValueError(f"shard layout mismatch at {what}: received a plain tensor for a DTensor")
    local = received.to_local()
    if (
        _placements(received) != _placements(target)
        or received.shape != target.shape
        or local.shape != target.to_local().shape
    ):
        raise ValueError(
            f"shard layout mismatch at {what}: received shape {tuple(received.shape)} "
            f"(local {tuple(local.shape)}, {_placements(received)}), this rank has "
            f"{tuple(target.shape)} (local {tuple(target.to_local().shape)}, "
            f"{_placements(target)})"
        )
    return DTensor.from_local(
        local.to(target.device),
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )


class HSDPState:
    """`state_dict` / `load_state_dict` of an FSDP2 model and its optimizer,
    for `Manager.set_state_dict_fns`.

    Args:
        model: the model after `fully_shard`.
        optimizer: the optimizer over its (DTensor) parameters; the
            torchft_like Optimizer wrapper or the inner torch optimizer.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        # A source serves its state from the Manager's quorum thread while the
        # training thread runs the forward pass. FSDP2's model.state_dict()
        # reshards the model first (a pre-hook), which would free the gathered
        # parameters under that forward. The tensors of one state_dict() share
        # storage with the sharded parameters, which the optimizer updates in
        # place, so one taken here stays current (torch's FSDP2 allows reusing it).
        self._model_state = model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "layout": _layout(self._model_state),
            "model": dict(self._model_state),
            "optim": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies a received shard in; ValueError if its layout differs from ours."""
        _check_layout(_layout(self._model_state), state.get("layout"))
        ours = self._model_state
        model_state = {k: _onto(v, ours[k], k) for k, v in state["model"].items()}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = state["optim"]
        optim_state = {}
        for index, entry in optim["state"].items():
            if not 0 <= int(index) < len(params):
                raise ValueError(
                    f"shard layout mismatch: optimizer state for parameter {index}, "
                    f"this rank's optimizer has {len(params)}"
                )
            param = params[int(index)]
            # Per-parameter tensors (exp_avg, ...) are DTensors shaped like the
            # parameter; scalars such as AdamW's step are plain tensors.
            optim_state[index] = {
                k: _onto(v, param, f"optimizer state {index}.{k}")
                if isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.dim() > 0)
                else v
                for k, v in entry.items()
            }
        # On the training thread, between steps: FSDP2's hooks may reshard here.
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict({**optim, "state": optim_state})
        self._model_state = self.model.state_dict()
