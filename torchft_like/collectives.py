"""A sum over the replicas that sends int8 instead of float (quantization.py).

Why this shape: an int8 allreduce cannot add int8 values on the wire (they
overflow, and each replica's blocks have their own scales). So the sum is a
reduce-scatter then an allgather, both on quantized bytes:

1. every replica quantizes its tensor and sends chunk r to replica r
   (alltoall): each replica receives every replica's copy of its own chunk;
2. it dequantizes them and adds them in float32, in replica rank order;
3. it quantizes its summed chunk again and every replica gathers every
   chunk (allgather), then dequantizes the whole tensor.

Each replica sends 2 (N-1)/N of the int8 payload, the same pattern as a
ring allreduce of floats, so the bytes on the wire drop to (1 + 4/block) / 4
of float32's at any number of replicas N (an allgather of everyone's whole
tensor would cost N/8 of it instead). Every replica ends with the same
bytes (the owner of a chunk decodes the gathered copy too), so replicas
stay bit-identical. The cost is two rounding errors, each at most half a
block's scale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from torchft_like import quantization
from torchft_like._work import FutureWork, completed_work, future_for


def allreduce_quantized(
    tensor: torch.Tensor, pg: Any, block_size: int = quantization.DEFAULT_BLOCK_SIZE
) -> dist.Work:
    """Sums a float tensor over `pg` in place, sent as blockwise int8.

    Blocks until the first round (the alltoall) is done and the second (the
    allgather) is issued: the second depends on the first, and issuing it
    from a callback would let replicas issue their collectives in different
    orders, which gloo cannot match. Call it through `InOrderCollectives`
    to keep the caller's thread free.

    Returns:
        A Work whose future completes with `tensor` once the sum is in it,
        or fails with the allgather's error.

    Raises:
        ValueError: `tensor` is not floating point.
        RuntimeError: the alltoall failed.
    """
    if not torch.is_floating_point(tensor):
        raise ValueError(f"allreduce_quantized takes a floating point tensor, got {tensor.dtype}")
    world = pg.size()
    if world == 1:
        return completed_work(tensor)
    numel = tensor.numel()
    chunk_blocks = max(1, quantization.num_blocks(numel, block_size * world))
    chunk_numel = chunk_blocks * block_size
    padded = torch.zeros(world * chunk_numel, dtype=torch.float32, device=tensor.device)
    padded[:numel] = tensor.detach().reshape(-1)
    chunk_bytes = quantization.packed_nbytes(chunk_blocks, block_size)
    send = torch.cat(
        [
            quantization.pack(*quantization.quantize_int8(chunk, block_size))
            for chunk in padded.split(chunk_numel)
        ]
    )
    # The codec runs on the tensor's device; the bytes travel from there over
    # NCCL, through host memory over gloo.
    wire = tensor.device if tensor.is_cuda and _device_native(pg) else torch.device("cpu")
    send = send.to(wire)
    received = torch.empty_like(send)
    splits = [chunk_bytes] * world
    pg.alltoall_base(received, send, splits, splits).wait()
    own = torch.zeros(chunk_numel, dtype=torch.float32, device=tensor.device)
    for piece in received.to(tensor.device).split(chunk_bytes):  # rank order: same sum everywhere
        own += quantization.unpack(piece, block_size)
    packed = quantization.pack(*quantization.quantize_int8(own, block_size)).to(wire)
    gathered = [torch.empty_like(packed) for _ in range(world)]

    def decode(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()
        whole = torch.cat(gathered).to(tensor.device)
        total = torch.cat([quantization.unpack(g, block_size) for g in whole.split(chunk_bytes)])
        tensor.copy_(total[:numel].view_as(tensor))
        return tensor

    return FutureWork(pg.allgather([gathered], [packed]).get_future().then(decode))


def _device_native(pg: Any) -> bool:
    """Whether `pg` moves CUDA tensors device to device (NCCL's groups)."""
    try:
        return "nccl" in str(pg.getBackendName()).lower()
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


class InOrderCollectives:
    """Issues collectives in the order they are asked for, off the caller's thread
    when one of them needs two rounds.

    Gloo matches collectives by the order each replica issues them, so a
    two-round collective (allreduce_quantized) runs in one worker thread,
    and any collective asked for while one is still unissued queues behind
    it; otherwise it is issued at once on the caller's thread.

    `abort` breaks the step (a member of its quorum is gone,
    torchft_like.manager.gone_watch): every allreduce in flight completes at once
    with its error, later ones fail at once, until `reset` (the next step).
    An abandoned gloo collective runs on to its timeout, and would write into
    its tensor if the gone member came back meanwhile (a SIGCONT): so by
    default each allreduce reduces a private copy (reused across steps, never
    after an abort) and only its completion copies the result into the
    caller's tensor. The price is one copy in per allreduce (the copy back is
    the division's pass) and one more copy of the buffers in flight in
    memory. A caller that can give up its tensor's memory after an abort
    (DDP's buckets: it builds new ones) passes `in_place` instead: no copy,
    and `abandoned` counts the tensors it must never use again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued = 0
        self._generation = 0
        """Bumped by abort: a worker thread abandoned then does not count."""
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: dict[int, tuple[Any, torch.Tensor, Callable[[Exception], None], bool]] = {}
        """id -> (its future, its tensor, its on_error, in place), until settled."""
        self._next_id = 0
        self._broken: Exception | None = None
        self._spare: dict[tuple[Any, ...], list[tuple[torch.Tensor, Any]]] = {}
        """(dtype, device, shape) -> private copies free for the next
        allreduce, each with the CUDA event after which it may be written
        (None on CPU): its last copy out ran on a callback's stream."""
        self.abandoned = 0
        """In-place tensors left to an abandoned collective so far (`abort`)."""

    def issue(
        self, start: Callable[[], dist.Work], two_rounds: bool, like: Any = None
    ) -> dist.Work:
        """`start()` issues the collective and returns its Work. Returns a
        Work that completes with it; errors from `start` fail that Work
        when it is queued, and raise here when it is not. `like`: what its
        value will hold (a CUDA tensor makes the future CUDA-aware)."""
        with self._lock:
            if not two_rounds and self._queued == 0:
                return start()
            self._queued += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="torchft_collectives")
            executor, generation = self._executor, self._generation
        result = future_for(like)
        # The worker issues on the caller's stream, as an unqueued call would:
        # that stream wrote the tensors it reads.
        stream = (
            torch.cuda.current_stream(like.device)
            if isinstance(like, torch.Tensor) and like.is_cuda
            else None
        )

        def settle(fut: torch.futures.Future[Any]) -> None:
            try:
                result.set_result(fut.value())
            except Exception as e:
                result.set_exception(e)

        def job() -> None:
            try:
                if stream is None:
                    work = start()
                else:
                    with torch.cuda.stream(stream):
                        work = start()
            except Exception as e:
                result.set_exception(e)
                return
            finally:
                with self._lock:
                    if generation == self._generation:
                        self._queued -= 1
            work.get_future().add_done_callback(settle)

        executor.submit(job)
        return FutureWork(result)

    def allreduce(
        self,
        tensor: torch.Tensor,
        pg: Any,
        quantize: bool,
        divide_by: int | None,
        on_error: Callable[[Exception], None],
        in_place: bool = False,
    ) -> dist.Work:
        """Sums `tensor` over `pg` in place, in order (`issue`), then divides
        it by `divide_by` if given; `quantize` sends it as int8
        (allreduce_quantized). Never raises, and the Work never fails: an
        error goes to `on_error` and the Work completes with the tensor
        (the Manager's wrap_future contract in one callback, one future less
        per bucket). `in_place`: gloo reduces `tensor` itself, which after an
        `abort` may still be written to (counted in `abandoned`), and the
        division comes first."""
        broken = self._broken
        if broken is not None:
            on_error(broken)
            return completed_work(tensor)
        shape = (tensor.dtype, tensor.device, tuple(tensor.shape))
        if in_place:
            private = tensor
            if divide_by is not None:
                # Divided first, on the caller's thread, as torch DDP's reducer
                # does: the bucket was just written there. On gloo's thread
                # after the sum it cost ~1.5 ms more CPU a 4M step (bench/NOTES.md).
                tensor.div_(divide_by)
        else:
            with self._lock:
                free = self._spare.get(shape)
                private, read = (
                    free.pop()
                    if free
                    else (torch.empty(shape[2], dtype=shape[0], device=shape[1]), None)
                )
            if read is not None:
                torch.cuda.current_stream(tensor.device).wait_event(read)
            private.copy_(tensor)
        out = future_for(tensor)
        with self._lock:  # in flight before it is issued: an abort between counts it
            key, self._next_id = self._next_id, self._next_id + 1
            self._in_flight[key] = (out, tensor, on_error, in_place)
        try:
            work = self.issue(
                (lambda: allreduce_quantized(private, pg))
                if quantize
                else (lambda: pg.allreduce([private], dist.ReduceOp.SUM)),
                two_rounds=quantize,
                like=private,
            )
        except Exception as e:
            with self._lock:
                if self._in_flight.pop(key, None) is None:
                    return FutureWork(out)  # aborted meanwhile: settled already
            on_error(e)
            return completed_work(tensor)

        def finish(fut: torch.futures.Future[Any]) -> None:
            with self._lock:
                if self._in_flight.pop(key, None) is None:
                    return  # aborted: settled already; `private` is never reused
            try:
                fut.value()
                if in_place:
                    pass  # reduced in `tensor` itself, divided before
                elif divide_by is None:
                    tensor.copy_(private)
                else:
                    torch.div(private, divide_by, out=tensor)
            except Exception as e:
                on_error(e)
            if not in_place:
                read = None
                if private.is_cuda:  # the copy out ran on this callback's stream
                    read = torch.cuda.Event()
                    read.record(torch.cuda.current_stream(private.device))
                with self._lock:
                    self._spare.setdefault(shape, []).append((private, read))
            out.set_result(tensor)

        work.get_future().add_done_callback(finish)
        return FutureWork(out)

    def abort(self, error: Exception) -> int:
        """Settles every allreduce in flight with `error` (its on_error, its
        tensor as the value) and fails later ones at once, until `reset`.
        A two-round collective's worker thread is abandoned. Returns how
        many were in flight."""
        with self._lock:
            self._broken = error
            self._spare = {}  # an abandoned collective may still write into its copy
            in_flight, self._in_flight = self._in_flight, {}
            self.abandoned += sum(1 for *_, in_place in in_flight.values() if in_place)
            executor, self._executor = self._executor, None
            self._queued = 0
            self._generation += 1
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for out, tensor, on_error, _ in in_flight.values():
            on_error(error)
            out.set_result(tensor)
        return len(in_flight)

    def reset(self) -> None:
        """A new step: collectives are issued again."""
        self._broken = None

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def quantized_nbytes(
    numel: int, world: int, block_size: int = quantization.DEFAULT_BLOCK_SIZE
) -> int:
    """Bytes one replica sends in `allreduce_quantized` of `numel` elements."""
    chunk_blocks = max(1, quantization.num_blocks(numel, block_size * world))
    return 2 * (world - 1) * quantization.packed_nbytes(chunk_blocks, block_size)


def ring_allreduce_nbytes(numel: int, world: int, element_size: int = 4) -> int:
    """Bytes one replica sends in a ring allreduce of `numel` elements."""
    return 2 * (world - 1) * numel * element_size // world
