"""Live state transfer over the replicas' process group instead of HTTP.

The source sends, to each healing replica rank, the same stream `_format`
defines for HTTP, as point-to-point messages on the quorum's process group:
the header length (one int64), the header (uint8 bytes), then each tensor
leaf's bytes, in tree order. Nothing is pickled; the receiver validates the
header and preallocates every tensor before a data byte arrives. On a GPU
process group (NCCL) this moves weights device to device; with gloo it is a
transport with no extra server or port.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from torchft_like.checkpointing import _checksum, _format
from torchft_like.checkpointing.transport import CheckpointTransport

T = TypeVar("T")


class PGTransport(CheckpointTransport[T], Generic[T]):
    """Sends healing state over `pg` (configured for the current quorum).

    Args:
        pg: the process group whose ranks are replica ranks.
        timeout: bound on each transfer when a call gives none.
        device: where received tensors are placed.
    """

    def __init__(self, pg: dist.ProcessGroup, timeout: timedelta, device: torch.device) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"timeout ({timeout}) must be positive")
        self._pg, self._timeout, self._device = pg, timeout, torch.device(device)

    def metadata(self) -> str:
        """See base class. The process group already connects the replicas."""
        return "<n/a>"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """See base class. Returns once every destination has the state, so
        nothing reads the tensors after it returns."""
        tree, tensors = _format.flatten(state_dict)
        header = _format.encode_header(step, tree, _checksum.DEFAULT)[_format.PREFIX.size :]
        payload = [torch.tensor([len(header)], dtype=torch.int64), _bytes_tensor(header)]
        payload += [_format.flat_bytes(t) for t in tensors if t.numel()]
        deadline = time.monotonic() + timeout.total_seconds()
        for dst in dst_ranks:
            for tensor in payload:
                _wait(self._pg.send([tensor], dst, 0), deadline, f"send of step {step} to {dst}")

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
        length = torch.zeros(1, dtype=torch.int64)
        _wait(self._pg.recv([length], src_rank, 0), deadline, what)
        if not 0 < int(length) <= _format.MAX_HEADER_BYTES:
            raise ValueError(f"{what}: header length {int(length)} is out of range")
        raw = torch.empty(int(length), dtype=torch.uint8)
        _wait(self._pg.recv([raw], src_rank, 0), deadline, what)
        header = _format.decode_header(bytes(_format.memview(raw)))
        received = [_format.empty(spec) for spec in header.specs]
        for tensor in received:
            if tensor.numel():
                flat = tensor.reshape(-1).view(torch.uint8)
                _wait(self._pg.recv([flat], src_rank, 0), deadline, what)
        if header.step != step:
            raise RuntimeError(f"{what}: the source is serving step {header.step}, not {step}")
        if self._device.type != "cpu":
            received = [t.to(self._device) for t in received]
        state: T = _format.unflatten(header.tree, received)
        return state


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
