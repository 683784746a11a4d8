"""Pickle-free state format: a JSON tree plus the raw bytes of each tensor.

The tree holds dicts (str or int keys, as optimizer state has), lists,
tuples, str, int, float, bool and None; each tensor leaf is replaced by
`{"__tensor__": index, "dtype", "shape", "nbytes", "device"}` and its bytes
travel after the header, in index order. A receiver preallocates every
tensor from the header and reads the bytes straight into it, and nothing
from the network is ever unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Splits `state` into a JSON-able tree and its tensors (in tree order)."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            dtype = str(obj.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise TypeError(f"{path}: tensors of dtype {obj.dtype} cannot be sent")
            tensors.append(obj)
            return {
                "__tensor__": len(tensors) - 1,
                "dtype": dtype,
                "shape": list(obj.shape),
                "nbytes": obj.numel() * obj.element_size(),
                "device": str(obj.device),
            }
        if isinstance(obj, dict):
            for key in obj:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"{path}: dict key {key!r} is not a str or an int")
            return {"__dict__": [[k, walk(v, f"{path}.{k}")] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            kind = "__list__" if isinstance(obj, list) else "__tuple__"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (str, int, float, bool)):
            return obj
        raise TypeError(f"{path}: values of type {type(obj).__name__} cannot be sent")

    return walk(state, "state"), tensors


def tensor_specs(tree: Any) -> list[dict[str, Any]]:
    """The tensor leaves of a received tree, validated, in index order."""
    specs: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "__tensor__" in node:
                specs.append(_check_spec(node))
            elif "__dict__" in node:
                for _key, value in node["__dict__"]:
                    walk(value)
            else:
                for value in node.get("__list__", node.get("__tuple__", [])):
                    walk(value)

    walk(tree)
    if [s["__tensor__"] for s in specs] != list(range(len(specs))):
        raise ValueError("malformed state header: tensor indices are not 0..n-1 in order")
    return specs


def _check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    dtype = DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
    shape = spec.get("shape")
    if dtype is None:
        raise ValueError(f"malformed state header: unknown dtype {spec.get('dtype')!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"malformed state header: bad shape {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    if spec.get("nbytes") != numel * torch.empty((), dtype=dtype).element_size():
        raise ValueError(
            f"malformed state header: nbytes {spec.get('nbytes')!r} does not fit {shape}"
        )
    return spec


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the state from a validated tree and its received tensors."""
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__dict__" in tree:
            return {key: unflatten(value, tensors) for key, value in tree["__dict__"]}
        if "__list__" in tree:
            return [unflatten(v, tensors) for v in tree["__list__"]]
        if "__tuple__" in tree:
            return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
        raise ValueError(f"malformed state header: unknown node {sorted(tree)}")
    if tree is None or isinstance(tree, (str, int, float, bool)):
        return tree
    raise ValueError(f"malformed state header: unexpected {type(tree).__name__}")


def empty_like_spec(spec: dict[str, Any]) -> torch.Tensor:
    return torch.empty(spec["shape"], dtype=DTYPES[spec["dtype"]])


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (it must be contiguous, on CPU)."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def chunks(nbytes: list[int], num_chunks: int) -> list[list[int]]:
    """Spreads tensor indices over `num_chunks` streams, largest first, onto
    the lightest stream; sender and receiver compute the same split."""
    streams: list[list[int]] = [[] for _ in range(max(1, num_chunks))]
    loads = [0] * len(streams)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        lightest = loads.index(min(loads))
        streams[lightest].append(index)
        loads[lightest] += nbytes[index]
    return [sorted(s) for s in streams]
