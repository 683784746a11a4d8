"""Device placement and host staging of checkpoint tensors.

Two questions every transport of CUDA state answers the same way:

- Where does a received (or restored) tensor go? `target_device`: a leaf
  the source held on the CPU stays on the CPU (optimizer step counters must,
  for a non-capturable Adam); a leaf it held on CUDA goes to the device the
  caller named, or else to this process's own GPU (`home_cuda_device`),
  never to whatever device happens to be current in the Manager's quorum
  thread (a thread's current device starts at cuda:0, so every rank of an
  8-GPU host would have healed onto GPU 0). Without CUDA it stays on the CPU.
- How do its bytes cross between device and host? `HostRing`: through a few
  reusable host buffers (pinned where CUDA is), on a side CUDA stream, one
  slice in flight while the caller works on the previous one. The sender
  overlaps the device-to-host copy with the socket; the receiver overlaps
  its memcpy into pinned memory with the DMA. Pinned memory stays bounded
  (`depth` x `slice_bytes`, 16 MiB by default) instead of a pinned copy of
  the whole model, which torch's caching host allocator would keep for good.

Nothing here touches CUDA for CPU tensors, so CPU-only runs stay as they were.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from torchft_like.checkpointing import state_format

SLICE = 8 << 20
"""Bytes per staged copy: as the HTTP transport's socket slices."""


def home_cuda_device() -> torch.device | None:
    """This process's GPU when nobody named one: cuda:(LOCAL_RANK % GPUs)
    (torchrun's convention, which `torch.cuda.set_device(local_rank)`
    follows), else the calling thread's current device; None without CUDA.
    A helper thread's current device is cuda:0 whatever the training
    thread set, so LOCAL_RANK comes first."""
    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        return torch.device("cuda", int(local) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def resolve_device(device: torch.device | str | None) -> torch.device | None:
    """A transport's receiving device, fixed in the thread that builds it:
    `device` with its index ("cuda" is this thread's current GPU); None
    names the current CUDA device where CUDA is initialized already (the
    training thread set it up), else stays None (`home_cuda_device` at
    receive time). Never initializes CUDA."""
    if device is not None:
        return _indexed(torch.device(device))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def target_device(recorded: str, device: torch.device | None) -> torch.device:
    """Where a leaf that the source held on `recorded` (e.g. "cuda:3") goes.

    Args:
        recorded: the source's device of the leaf, as the header says it.
        device: the receiver's device for accelerator leaves (see
            `resolve_device`); None: this process's GPU
            (`home_cuda_device`), or the CPU without CUDA.
    """
    if not recorded.startswith("cuda"):
        return torch.device("cpu")
    if device is not None:
        return _indexed(torch.device(device))
    home = home_cuda_device()
    return home if home is not None else torch.device("cpu")


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" alone is the caller's current GPU)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(device: torch.device) -> AbstractContextManager[Any]:
    """Makes `device` current in this thread for CUDA calls that use the
    current device (pinned allocation, streams, events): a helper thread's
    current device is cuda:0, and using it would create a context there."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def record_ready(tensors: Iterable[torch.Tensor]) -> dict[torch.device, Any]:
    """An event per CUDA device holding one of `tensors`, recorded on the
    caller's current stream of it: copies on a side stream wait for it, so
    they read what the caller's stream wrote before. Empty (no CUDA call)
    when none is on CUDA."""
    devices = {t.device for t in tensors if t.is_cuda}
    events: dict[torch.device, Any] = {}
    for device in devices:
        with on_device(device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event
    return events


def streams_done(state: Any) -> Any:
    """`state`, once the calling thread's current streams of its CUDA devices
    have finished writing it. Called on the training thread where a healing
    peer's state is read (manager.settling): the transport copies it from
    another thread, whose current streams are not the training's. A host
    wait, only when serving a heal; no CUDA call without CUDA tensors."""
    devices: set[torch.device] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                devices.add(x.device)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(state)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return state


class HostRing:
    """`depth` reusable host buffers of `slice_bytes` for copies between a
    device tensor and host memory, one slice at a time.

    On CUDA the buffers are pinned and the copies run on a side stream
    (non_blocking), so one slice moves while the caller uses another and
    the training stream is not serialized behind them. On the CPU (`pin`
    False, no stream) the same code runs as plain copies, which is how the
    CPU tests check it.

    Args:
        device: the device side of the copies.
        slice_bytes: bytes per buffer.
        depth: buffers, and so slices in flight at once (at least 1).
        pin: pin the buffers; None: where `device` is CUDA.
    """

    def __init__(
        self,
        device: torch.device,
        slice_bytes: int = SLICE,
        depth: int = 2,
        pin: bool | None = None,
    ) -> None:
        if slice_bytes < 1 or depth < 1:
            raise ValueError(f"slice_bytes ({slice_bytes}) and depth ({depth}) must be positive")
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        pin = cuda if pin is None else pin
        self.slice_bytes = slice_bytes
        with on_device(self.device):
            self._bufs = [
                torch.empty(slice_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(depth)
            ]
            self._stream: Any = torch.cuda.Stream(device=self.device) if cuda else None
        self._events: list[Any] = [None] * depth

    @property
    def pinned(self) -> bool:
        return self._bufs[0].is_pinned()

    def _slices(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(lo, min(lo + self.slice_bytes, end)) for lo in range(start, end, self.slice_bytes)]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> None:
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[slot] = event

    def _settle(self, slot: int) -> None:
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            event.synchronize()

    def _follow(self, after: Any = None) -> None:
        """The side stream waits for the caller's stream (fresh allocations,
        a contiguous copy) and for `after`, an event of the writer."""
        if self._stream is None:
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self._stream.wait_event(after)

    def read(
        self, flat: torch.Tensor, start: int, end: int, after: Any = None
    ) -> Generator[memoryview, None, None]:
        """Host views of `flat[start:end]` (a 1-D uint8 device tensor), slice
        by slice in order; the next slices copy while the caller uses one.
        A view is valid until the next one is asked for. `after`: a CUDA
        event the copies wait for (`record_ready`). On return, or when the
        caller stops early, every copy has finished, so `flat` may be
        freed or written."""
        slices = self._slices(start, end)
        depth = len(self._bufs)

        def issue(i: int) -> None:
            lo, hi = slices[i]
            self._copy(self._bufs[i % depth][: hi - lo], flat[lo:hi], i % depth)

        with on_device(self.device):
            try:
                self._follow(after)
                for i in range(min(depth, len(slices))):
                    issue(i)
                for i, (lo, hi) in enumerate(slices):
                    self._settle(i % depth)
                    yield state_format.memview(self._bufs[i % depth][: hi - lo])
                    if i + depth < len(slices):
                        issue(i + depth)
            finally:
                self.finish()

    def write(self, flat: torch.Tensor, source: torch.Tensor) -> None:
        """Copies `source` (a 1-D uint8 CPU tensor) into `flat` (a 1-D uint8
        device tensor of the same size) through the ring; call `finish`
        before anyone reads `flat`."""
        if flat.numel() != source.numel():
            raise ValueError(f"{source.numel()} bytes to write into {flat.numel()}")
        depth = len(self._bufs)
        with on_device(self.device):
            self._follow()
            for i, (lo, hi) in enumerate(self._slices(0, source.numel())):
                slot = i % depth
                self._settle(slot)  # its previous slice has left the buffer
                buf = self._bufs[slot][: hi - lo]
                buf.copy_(source[lo:hi])
                self._copy(flat[lo:hi], buf, slot)

    def finish(self) -> None:
        """Waits until every copy issued has finished."""
        if self._stream is not None:
            with on_device(self.device):
                self._stream.synchronize()
        self._events = [None] * len(self._events)


def place(
    specs: list[state_format.TensorSpec], tensors: list[torch.Tensor], device: torch.device | None
) -> list[torch.Tensor]:
    """Received CPU tensors moved to where they belong (`target_device` of
    each spec's recorded device), through a `HostRing` per device; returns
    once every copy has finished, so the tensors may be handed to another
    thread. CPU leaves are returned as they are (no CUDA call when all are)."""
    targets = [target_device(spec.device, device) for spec in specs]
    if all(t.type == "cpu" for t in targets):
        return tensors
    rings: dict[torch.device, HostRing] = {}
    out: list[torch.Tensor] = []
    for tensor, target in zip(tensors, targets):
        if target.type == "cpu":
            out.append(tensor)
            continue
        with on_device(target):
            dst = torch.empty(tensor.shape, dtype=tensor.dtype, device=target)
            if tensor.numel():
                ring = rings.get(target)
                if ring is None:
                    ring = rings[target] = HostRing(target)
                ring.write(state_format.flat_bytes(dst), state_format.flat_bytes(tensor))
        out.append(dst)
    for ring in rings.values():
        ring.finish()
    return out
