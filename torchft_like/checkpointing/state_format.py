"""The pickle-free wire format of a state dict: a JSON tree, then raw tensor bytes.

A stream is, in order:

1. a 16-byte prefix: the magic ``b"TFLSTAT1"`` and the header length as an
   unsigned 64-bit big-endian integer;
2. the header, UTF-8 JSON: ``{"format": 2, "step": int, "checksum": name,
   "tree": node}``, where name is "crc32c" or "crc32" (zlib's);
3. the bytes of the tensor leaves, in the order they appear in the tree
   (depth first, dict items in insertion order), or the byte range
   ``[start, end)`` of that concatenation when the stream is one chunk;
4. the trailer: per segment of that range (`segments`: the part of one
   tensor that falls in it), the checksum of its bytes as an unsigned
   32-bit big-endian integer. A receiver verifies every tensor segment
   before it hands the state to anyone, so a corrupted or truncated
   transfer is refused, never applied.

A node is a JSON null, bool, int, float or string standing for itself, or
an object with exactly one key:

- ``{"dict": [[key, node], ...]}`` with str or int keys (optimizer state
  dicts are keyed by parameter index, and JSON objects only allow str keys);
- ``{"list": [node, ...]}`` and ``{"tuple": [node, ...]}``;
- ``{"tensor": {"dtype": "bfloat16", "shape": [2, 3], "nbytes": 12,
  "device": "cuda:0"}}``, a leaf whose bytes follow the header;
- ``{"dtensor": {"local": {"tensor": ...}, ...}}``, a DTensor: its local
  shard's bytes follow the header like any tensor leaf, and its mesh,
  placements, shape and stride are in the node (see `dtensor`).

Nothing read from the network is ever unpickled: `decode_header` accepts
exactly this grammar and raises ValueError on anything else, so a receiver
can preallocate every tensor before a single data byte arrives.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"TFLSTAT1"
PREFIX = struct.Struct("!8sQ")
FORMAT_VERSION = 2
MAX_HEADER_BYTES = 64 << 20
"""Far above any real model's tree (about 150 bytes a tensor); a bound so a
bad peer cannot make us allocate without limit."""

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint64,
        torch.uint32,
        torch.uint16,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to preallocate one tensor leaf."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    device: str
    path: str = "state"
    """Its key path, e.g. ``state['model']['w']``, for error messages."""


@dataclass(frozen=True)
class Header:
    """A validated header: the step, the tree and its tensor leaves in order."""

    step: int
    tree: Any
    specs: list[TensorSpec]
    checksum: str = "crc32c"


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Splits `state` into a JSON-able tree and its tensor leaves, in order.

    Raises:
        TypeError: a value, key or tensor that the format cannot carry; the
            message names its key path, e.g. ``state['optim'][0]``.
    """
    tensors: list[torch.Tensor] = []

    def leaf(tensor: torch.Tensor, path: str) -> Any:
        tensors.append(tensor)
        return {"tensor": _tensor_leaf(tensor, path)}

    def walk(obj: Any, path: str) -> Any:
        if _is_dtensor(obj):
            from torchft_like.checkpointing import dtensor

            return dtensor.encode(obj, path, leaf)
        if isinstance(obj, torch.Tensor):
            return leaf(obj, path)
        if isinstance(obj, dict):
            items = []
            for key, value in obj.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"{path}: dict key {key!r} is not a str or an int")
                items.append([key, walk(value, f"{path}[{key!r}]")])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if obj is None or type(obj) in (str, int, float, bool):
            return obj
        raise TypeError(f"{path}: values of type {type(obj).__name__} cannot be sent")

    return walk(state, "state"), tensors


def _tensor_leaf(tensor: torch.Tensor, path: str) -> dict[str, Any]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"{path}: tensor subclass {type(tensor).__name__} cannot be sent; only plain "
            "tensors, Parameters and DTensors can (send its plain tensors instead)"
        )
    if dtype not in DTYPES:
        raise TypeError(f"{path}: tensors of dtype {tensor.dtype} cannot be sent")
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise TypeError(f"{path}: {tensor.layout} tensor on {tensor.device} has no plain bytes")
    return {
        "dtype": dtype,
        "shape": list(tensor.shape),
        "nbytes": tensor.numel() * tensor.element_size(),
        "device": str(tensor.device),
    }


def encode_header(step: int, tree: Any, checksum: str) -> bytes:
    """The prefix and JSON header of a stream for `step`."""
    doc = {"format": FORMAT_VERSION, "step": step, "checksum": checksum, "tree": tree}
    body = json.dumps(doc).encode()
    return PREFIX.pack(MAGIC, len(body)) + body


def decode_prefix(prefix: bytes) -> int:
    """The header length announced by a stream's 16-byte prefix."""
    if len(prefix) != PREFIX.size:
        raise ValueError(f"stream ended after {len(prefix)} of {PREFIX.size} prefix bytes")
    magic, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ValueError(f"not a torchft_like state stream: magic {magic!r}, want {MAGIC!r}")
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"header of {length} bytes exceeds the {MAX_HEADER_BYTES} byte limit")
    return length


def decode_header(body: bytes) -> Header:
    """Parses and validates a JSON header; every error is a ValueError."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise ValueError("header must be an object with a format")
    if doc["format"] != FORMAT_VERSION:
        raise ValueError(f"format {doc['format']!r} is not supported (want {FORMAT_VERSION})")
    if set(doc) != {"format", "step", "checksum", "tree"}:
        raise ValueError("header must be an object with exactly format, step, checksum and tree")
    if type(doc["step"]) is not int:
        raise ValueError(f"step {doc['step']!r} is not an int")
    if not isinstance(doc["checksum"], str):
        raise ValueError(f"checksum {doc['checksum']!r} is not an algorithm name")
    specs: list[TensorSpec] = []
    try:
        _check_node(doc["tree"], specs, "state")
    except RecursionError:
        raise ValueError("header tree is nested too deeply") from None
    return Header(doc["step"], doc["tree"], specs, doc["checksum"])


def _check_node(node: Any, specs: list[TensorSpec], path: str) -> None:
    if node is None or type(node) in (str, int, float, bool):
        return
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"{path}: unexpected node {str(node)[:80]!r}")
    [(kind, value)] = node.items()
    if kind == "tensor":
        specs.append(_check_spec(value, path))
    elif kind == "dtensor":
        from torchft_like.checkpointing import dtensor

        local = dtensor.check(value, path)
        if not (isinstance(local, dict) and set(local) == {"tensor"}):
            raise ValueError(f"{path}: a dtensor's local shard must be a tensor node")
        _check_node(local, specs, path)
    elif kind == "dict" and isinstance(value, list):
        for item in value:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                raise ValueError(f"{path}: dict items must be [str or int key, node] pairs")
            _check_node(item[1], specs, f"{path}[{item[0]!r}]")
    elif kind in ("list", "tuple") and isinstance(value, list):
        for i, child in enumerate(value):
            _check_node(child, specs, f"{path}[{i}]")
    else:
        raise ValueError(
            f"{path}: unknown node kind {kind!r} (want dict, list, tuple, tensor, dtensor)"
        )


def _check_spec(leaf: Any, path: str) -> TensorSpec:
    if not isinstance(leaf, dict) or set(leaf) != {"dtype", "shape", "nbytes", "device"}:
        raise ValueError(f"{path}: a tensor leaf has exactly dtype, shape, nbytes and device")
    dtype = DTYPES.get(leaf["dtype"]) if isinstance(leaf["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"{path}: unknown dtype {leaf['dtype']!r}")
    shape = leaf["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{path}: bad shape {shape!r} (want a list of ints >= 0)")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if leaf["nbytes"] != nbytes:
        raise ValueError(f"{path}: nbytes {leaf['nbytes']!r} does not fit {dtype} {shape}")
    device = leaf["device"]
    if not isinstance(device, str) or len(device) > 32:
        raise ValueError(f"{path}: bad device {device!r}")
    return TensorSpec(dtype, tuple(shape), nbytes, device, path)


def _is_dtensor(obj: Any) -> bool:
    """Whether `obj` is a DTensor, without importing torch.distributed.tensor:
    that import costs every worker start 0.5-1.7 s, and no DTensor exists
    unless something imported it already. dtensor is imported on first use."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds the state from a validated tree and its tensors, in order."""
    leaves = iter(tensors)
    meshes: dict[str, Any] = {}  # mesh description -> DeviceMesh, shared by DTensor leaves

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        [(kind, value)] = node.items()
        if kind == "tensor":
            return next(leaves)
        if kind == "dtensor":
            from torchft_like.checkpointing import dtensor

            return dtensor.build(value, next(leaves), meshes)
        if kind == "dict":
            return {key: build(child) for key, child in value}
        children = [build(child) for child in value]
        return children if kind == "list" else tuple(children)

    return build(tree)


def chunk_ranges(total: int, num_chunks: int) -> list[tuple[int, int]]:
    """Splits `total` data bytes into `num_chunks` near-equal byte ranges.

    Splitting bytes, not tensors, balances the streams even when one
    embedding holds most of the model.
    """
    n = max(1, num_chunks)
    return [(total * i // n, total * (i + 1) // n) for i in range(n)]


def segments(nbytes: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """The (tensor index, offset, length) pieces of the byte range [start, end)."""
    out = []
    base = 0
    for index, size in enumerate(nbytes):
        lo, hi = max(start, base), min(end, base + size)
        if lo < hi:
            out.append((index, lo - base, hi - lo))
        base += size
    return out


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a 1-D uint8 tensor on its device; copies only when strided
    or lazily conjugated/negated, so the live weights are read in place."""
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def memview(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, with no copy.

    It does not keep the tensor alive: the caller holds it while the view is
    in use. ctypes rather than numpy, which torch does not require.
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def empty(spec: TensorSpec) -> torch.Tensor:
    """An uninitialized CPU tensor to receive one leaf into.

    torch.empty does not touch the memory, so each page is faulted in once,
    by the socket read that fills it. (Asking for transparent huge pages
    with madvise was measured too: no steady gain on our VMs, so not done.)
    """
    return torch.empty(spec.shape, dtype=spec.dtype)
