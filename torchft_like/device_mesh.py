"""A device mesh whose replicate dimension is fault tolerant (FT-HSDP).

Each replica group is its own torchrun job: its ranks form the default
process group, which shards the model (FSDP2's shard dimension). The
replicate dimension spans the replica groups, which come and go; it is a
`ManagedProcessGroup`, so the gradient all-reduce FSDP2 runs on it goes
through `Manager.allreduce` (averaged over the live groups, errors recorded
rather than raised, the step not committed).

torch's DeviceMesh locates this rank by its rank in the default group, which
is its rank inside the replica group; so the mesh tensor has size 1 along the
replicate dimension (every group sees itself at replicate coordinate 0), while
the replicate process group reports the quorum's size. FSDP2 reads sizes and
ranks from the process groups, not the mesh tensor, for its reductions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchft_like.process_group.managed import ManagedProcessGroup


def managed_device_mesh(
    replicate_pg: ManagedProcessGroup,
    inner: DeviceMesh,
    replicate_dim: int,
    replicate_dim_name: str,
) -> DeviceMesh:
    """`inner` (a mesh over this replica group's ranks) with a replicate
    dimension inserted at `replicate_dim`, served by `replicate_pg`.

    `replicate_pg` must be registered (`replicate_pg.register(name)`): torch
    finds a mesh's groups by name.
    """
    if inner.mesh_dim_names is None:
        raise ValueError("the inner mesh needs mesh_dim_names (FSDP2 needs names on a 2-D mesh)")
    if not 0 <= replicate_dim <= inner.ndim:
        raise ValueError(f"replicate_dim {replicate_dim} must be in [0, {inner.ndim}]")
    if replicate_dim_name in inner.mesh_dim_names:
        raise ValueError(f"dimension name {replicate_dim_name!r} is already in the inner mesh")
    groups: list[Any] = [inner.get_group(d) for d in range(inner.ndim)]
    groups.insert(replicate_dim, replicate_pg)
    names = list(inner.mesh_dim_names)
    names.insert(replicate_dim, replicate_dim_name)
    return DeviceMesh.from_group(
        groups,
        inner.device_type,
        mesh=inner.mesh.unsqueeze(replicate_dim),
        mesh_dim_names=tuple(names),
    )


def ft_init_device_mesh(
    *,
    device_type: str,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...],
    replicate_dim: int,
    manager: Any,
) -> DeviceMesh:
    """torchft's entry point: `init_device_mesh` where dimension `replicate_dim`
    spans the replica groups through `manager`.

    The other dimensions cover this replica group's ranks (their product must
    be its world size). The size given for the replicate dimension is
    ignored: it is the number of live replica groups, which the quorum
    decides each step.

    Example (HSDP, 2 ranks per group, any number of groups):

        mesh = ft_init_device_mesh(device_type="cpu", mesh_shape=(2, 2),
                                   mesh_dim_names=("dp_replicate", "dp_shard"),
                                   replicate_dim=0, manager=manager)
        fully_shard(model, mesh=mesh)
    """
    if len(mesh_shape) != len(mesh_dim_names):
        raise ValueError(
            f"mesh_shape {mesh_shape} and mesh_dim_names {mesh_dim_names} differ in length"
        )
    if not 0 <= replicate_dim < len(mesh_shape):
        raise ValueError(f"replicate_dim {replicate_dim} is not a dimension of {mesh_shape}")
    if not dist.is_initialized():
        raise RuntimeError(
            "ft_init_device_mesh needs the replica group's default process group: "
            "call torch.distributed.init_process_group() first (torchrun sets its variables)"
        )
    shape = list(mesh_shape)
    names = list(mesh_dim_names)
    del shape[replicate_dim]
    replicate_name = names.pop(replicate_dim)
    world = dist.get_world_size()
    if int(torch.tensor(shape).prod()) != world:
        raise ValueError(
            f"the dimensions other than {replicate_name!r} ({dict(zip(names, shape))}) must "
            f"multiply to this replica group's world size, {world}"
        )
    inner = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    replicate_pg = ManagedProcessGroup(manager).register(replicate_name)
    return managed_device_mesh(replicate_pg, inner, replicate_dim, replicate_name)
