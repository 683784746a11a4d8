"""DTensor leaves of the state format: the local shard's bytes plus its layout.

FSDP and tensor-parallel models hold DTensors. Only the local shard has
bytes on this rank; the rest is metadata (the device mesh, the placements,
the global shape and stride), which travels as JSON in the header:

  {"dtensor": {"local": {"tensor": leaf}, "device_type": "cpu",
               "mesh": nested list of ranks, "dim_names": [str] or null,
               "placements": ["replicate" | {"shard": dim} | {"partial": op}],
               "shape": [int], "stride": [int]}}

A healing rank r takes its state from rank r of a source group, which
holds the same shard, so the receiver rebuilds the DTensor around the
received shard on a mesh of the same description, created in the receiving
thread (DeviceMesh equality includes the creating thread). Its process
groups are set up only when that is local (a 1-D mesh over the whole
default group); otherwise creating them would be a collective that other
ranks are not in, so the mesh carries the layout only. That is what
`load_state_dict` needs: it copies the local shard into the model's own
DTensor, whose mesh has the same description.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

KEYS = {"local", "device_type", "mesh", "dim_names", "placements", "shape", "stride"}


def encode(tensor: DTensor, path: str, leaf: Callable[[torch.Tensor, str], Any]) -> Any:
    """The header node of a DTensor; `leaf` encodes (and collects) its local shard."""
    mesh = tensor.device_mesh
    return {
        "dtensor": {
            "local": leaf(tensor.to_local(), path),
            "device_type": mesh.device_type,
            "mesh": mesh.mesh.tolist(),
            "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "placements": [_placement(p, path) for p in tensor.placements],
            "shape": list(tensor.shape),
            "stride": list(tensor.stride()),
        }
    }


def _placement(placement: Placement, path: str) -> Any:
    if type(placement) is Replicate:
        return "replicate"
    if type(placement) is Shard:
        return {"shard": placement.dim}
    if type(placement) is Partial:
        return {"partial": placement.reduce_op}
    raise TypeError(f"{path}: DTensor placement {placement!r} cannot be sent")


def check(node: Any, path: str) -> Any:
    """Validates a DTensor node's metadata (ValueError); returns its local node."""
    if not isinstance(node, dict) or set(node) != KEYS:
        raise ValueError(f"{path}: a dtensor node has exactly {sorted(KEYS)}")
    if node["device_type"] not in ("cpu", "cuda"):
        raise ValueError(f"{path}: unknown mesh device type {node['device_type']!r}")
    names = node["dim_names"]
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names)
    ):
        raise ValueError(f"{path}: dim_names {names!r} must be null or a list of strings")
    for key in ("shape", "stride"):
        if not (isinstance(node[key], list) and all(type(d) is int and d >= 0 for d in node[key])):
            raise ValueError(f"{path}: bad {key} {node[key]!r} (want a list of ints >= 0)")
    if not _is_rank_grid(node["mesh"]):
        raise ValueError(f"{path}: mesh {str(node['mesh'])[:80]!r} is not a grid of ranks")
    if not isinstance(node["placements"], list):
        raise ValueError(f"{path}: placements must be a list")
    for placement in node["placements"]:
        _decode_placement(placement, path)
    return node["local"]


def _is_rank_grid(mesh: Any) -> bool:
    if type(mesh) is int:
        return mesh >= 0
    return isinstance(mesh, list) and all(_is_rank_grid(m) for m in mesh)


def _decode_placement(node: Any, path: str) -> Placement:
    if node == "replicate":
        return Replicate()
    if isinstance(node, dict) and len(node) == 1:
        [(kind, value)] = node.items()
        if kind == "shard" and type(value) is int and value >= 0:
            return Shard(value)
        if kind == "partial" and value in ("sum", "avg", "max", "min"):
            return Partial(value)
    raise ValueError(f"{path}: unknown placement {str(node)[:80]!r}")


def build(node: Any, local: torch.Tensor, meshes: dict[str, DeviceMesh]) -> DTensor:
    """The DTensor of a validated node around its received local shard.

    `meshes` caches the meshes made for one state, so its DTensors share one.
    """
    names = tuple(node["dim_names"]) if node["dim_names"] else None
    key = repr((node["device_type"], node["mesh"], names))
    mesh = meshes.get(key)
    if mesh is None:
        ranks = torch.tensor(node["mesh"], dtype=torch.int)
        local_groups = (
            dist.is_initialized()
            and ranks.dim() == 1
            and ranks.tolist() == list(range(dist.get_world_size()))
        )
        mesh = meshes[key] = DeviceMesh(
            node["device_type"], ranks, mesh_dim_names=names, _init_backend=local_groups
        )
    placements = tuple(_decode_placement(p, "state") for p in node["placements"])
    meta = TensorMeta(torch.Size(node["shape"]), tuple(node["stride"]), local.dtype)
    # Not DTensor.from_local: on a rank outside the mesh it drops the shard.
    return DTensor(local, DTensorSpec(mesh, placements, meta), requires_grad=False)
