"""Live state transfer over the replicas' process group instead of HTTP.

The source sends, to each healing replica rank, the same stream `state_format`
defines for HTTP, as point-to-point messages on the quorum's process group:
the header length (one int64), the header (uint8 bytes), then each tensor
leaf's bytes, in tree order. Nothing is pickled; the receiver validates the
header and preallocates every tensor before a data byte arrives.

Where the bytes travel (the wire device) follows the group's backend:

- NCCL (a backend name containing "nccl"): on the GPU, device to device. The
  header and any CPU leaf are copied to the GPU to be sent, one leaf at a
  time; received leaves land on the GPU and only those the source held on
  the CPU are copied back to the CPU.
- gloo and any other: host memory. CUDA leaves are copied to the host one
  at a time (the next while the previous is sent) and, at the receiver,
  copied onto the GPU through pinned buffers (`staging`). Our gloo groups
  would stage CUDA tensors themselves; torch's own gloo group would not
  take them for send/recv, so the transport stages for both.

A CPU-only state over gloo sends exactly the messages it always did.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from torchft_like.checkpointing import checksum, staging, state_format
from torchft_like.checkpointing.transport import CheckpointTransport

T = TypeVar("T")


def backend_name(pg: Any) -> str:
    """The backend's name as the group reports it ("" if it cannot)."""
    for method in ("getBackendName", "name", "_get_backend_name"):
        getter = getattr(pg, method, None)
        if callable(getter):
            try:
                return str(getter())
            except Exception:
                continue
    return ""


def wire_device(pg: Any, device: torch.device | None) -> torch.device:
    """Where PGTransport's bytes travel on `pg`: its GPU for NCCL (`device`
    when it is CUDA, else this process's GPU), the host for any other."""
    if "nccl" not in backend_name(pg).lower():
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    home = staging.home_cuda_device()
    if home is None:
        raise RuntimeError("PGTransport over NCCL needs a CUDA GPU, and this process sees none")
    return home


class PGTransport(CheckpointTransport[T], Generic[T]):
    """Sends healing state over `pg` (configured for the current quorum).

    Args:
        pg: the process group whose ranks are replica ranks.
        timeout: bound on each transfer when a call gives none.
        device: where received leaves that the source held on CUDA go (the
            device this rank's model lives on); leaves it held on the CPU
            stay on the CPU. On NCCL also the device the bytes travel on.
    """

    def __init__(self, pg: dist.ProcessGroup, timeout: timedelta, device: torch.device) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"timeout ({timeout}) must be positive")
        self._pg, self._timeout = pg, timeout
        self._device = staging.resolve_device(device) or torch.device("cpu")

    def metadata(self) -> str:
        """See base class. The process group already connects the replicas."""
        return "<n/a>"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """See base class. Returns once every destination has the state, so
        nothing reads the tensors after it returns."""
        tree, tensors = state_format.flatten(state_dict)
        header = state_format.encode_header(step, tree, checksum.DEFAULT)[
            state_format.PREFIX.size :
        ]
        wire = wire_device(self._pg, self._device)
        payload = [torch.tensor([len(header)], dtype=torch.int64), _bytes_tensor(header)]
        payload += [state_format.flat_bytes(t) for t in tensors if t.numel()]
        deadline = time.monotonic() + timeout.total_seconds()
        if all(t.device == wire for t in payload):  # a CPU state over gloo: as always
            for dst in dst_ranks:
                for tensor in payload:
                    _wait(
                        self._pg.send([tensor], dst, 0), deadline, f"send of step {step} to {dst}"
                    )
            return
        # One staged copy per leaf at a time, sent to every destination; the
        # next leaf is copied while this one is on the wire.
        staged = _staged(payload, wire)
        current = next(staged, None)
        while current is not None:
            works = [self._pg.send([current], dst, 0) for dst in dst_ranks]
            following = next(staged, None)
            for dst, work in zip(dst_ranks, works):
                _wait(work, deadline, f"send of step {step} to {dst}")
            current = following

    def disallow_checkpoint(self) -> None:
        """See base class. Sends finish in send_checkpoint: nothing to stop."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """See base class.

        Raises:
            RuntimeError: the transfer did not finish within `timeout` (the
                message says "timed out"), or the source sent another step
                (received to the end first, so the source is not left
                waiting on a send nobody takes).
            ValueError: the source sent an invalid header.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        what = f"recv of step {step} from replica rank {src_rank}"
        wire = wire_device(self._pg, self._device)
        with staging.on_device(wire):
            length = torch.zeros(1, dtype=torch.int64, device=wire)
            _wait(self._pg.recv([length], src_rank, 0), deadline, what)
            if not 0 < int(length) <= state_format.MAX_HEADER_BYTES:
                raise ValueError(f"{what}: header length {int(length)} is out of range")
            raw = torch.empty(int(length), dtype=torch.uint8, device=wire)
            _wait(self._pg.recv([raw], src_rank, 0), deadline, what)
            header = state_format.decode_header(bytes(state_format.memview(raw.cpu())))
            if wire.type == "cpu":
                received = [state_format.empty(spec) for spec in header.specs]
                for tensor in received:
                    if tensor.numel():
                        flat = tensor.reshape(-1).view(torch.uint8)
                        _wait(self._pg.recv([flat], src_rank, 0), deadline, what)
            else:
                received = self._recv_on_device(header.specs, wire, src_rank, deadline, what)
        if header.step != step:
            raise RuntimeError(f"{what}: the source is serving step {header.step}, not {step}")
        if wire.type == "cpu":
            received = staging.place(header.specs, received, self._device)
        state: T = state_format.unflatten(header.tree, received)
        return state

    def _recv_on_device(
        self,
        specs: list[state_format.TensorSpec],
        wire: torch.device,
        src_rank: int,
        deadline: float,
        what: str,
    ) -> list[torch.Tensor]:
        """Every leaf received on the GPU `wire`; a leaf whose target is not
        the wire (the source held it on the CPU) copied there after. Returns
        once the device has finished, so another thread may use them."""
        out = []
        for spec in specs:
            target = staging.target_device(spec.device, self._device)
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=wire)
            if tensor.numel():
                _wait(self._pg.recv([state_format.flat_bytes(tensor)], src_rank, 0), deadline, what)
            out.append(tensor if target == wire else tensor.to(target))
        torch.cuda.current_stream(wire).synchronize()
        return out


def _staged(payload: list[torch.Tensor], wire: torch.device) -> Iterator[torch.Tensor]:
    """`payload` on the wire device, one copy at a time (each is dropped once
    the caller moves to the next: no whole-model copy at once)."""
    for tensor in payload:
        if tensor.device == wire:
            yield tensor
        else:
            with staging.on_device(wire if wire.type == "cuda" else tensor.device):
                yield tensor.to(wire)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _wait(work: dist.Work, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RuntimeError(f"{what} timed out before it began")
    try:
        work.wait(timedelta(seconds=remaining))
    except Exception as e:
        raise RuntimeError(f"{what} failed or timed out: {e}") from e
