"""ProcessGroupNCCL: torch's NCCL backend rebuilt on every new quorum.

What differs from the gloo group, and why:

- An NCCL collective returns to the host at once; it finishes (or hangs) on
  the device. A collective past its timeout must abort the communicator
  without any host thread blocking on it: a watchdog thread looks at the
  collectives in flight (`in_flight.InFlight`, their works' non-blocking
  `is_completed()`) and aborts at the first overdue one. torch's own NCCL
  watchdog is given a later timeout, so that ours acts first, and by abort
  rather than by tearing the process down.
- The communicator is non-blocking (`config.blocking = False`), so that
  `abort()` (ncclCommAbort) returns while kernels hang, and ends them.
- `errored()` waits for this group's collectives to finish on the device
  (never past their timeout: the watchdog aborts them), because a
  collective's failure is known only then. The Manager asks it once a step,
  at the commit vote; torchft synchronizes the whole device there instead.

The backend is built by a factory (`backend_factory`), real NCCL by
default; the tests inject gloo, which has the same backend API, to drive
this state machine on a machine without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from torchft_like._work import FutureWork, future_for
from torchft_like.process_group.base import (
    Registrable,
    broadcast_options,
    unsupported,
    with_reduce_op,
)
from torchft_like.process_group.gloo import parse_store_addr
from torchft_like.process_group.gloo_work import all_of
from torchft_like.process_group.in_flight import Issued
from torchft_like.process_group.watchdog import Watchdog

logger = logging.getLogger(__name__)

BackendFactory = Callable[[dist.Store, int, int, timedelta], Any]
"""(store, rank, world_size, timeout) -> a c10d backend (NCCL's, or gloo's in tests)."""

DROP_WAIT_S = 10.0
"""How long configure() waits for the previous communicator's abort, so
that its memory is back before the next one is built."""


def nccl_missing() -> str | None:
    """Why this machine cannot run NCCL, in one line; None if it can."""
    if not torch.cuda.is_available():
        return (
            f"NCCL needs a CUDA GPU: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}); use ProcessGroupGloo, or run on a machine with a GPU "
            "and a CUDA build of torch"
        )
    if not dist.is_nccl_available():
        return (
            f"this torch build ({torch.__version__}) has no NCCL "
            "(torch.distributed.is_nccl_available() is False); install a CUDA build of torch"
        )
    return None


def require_nccl(what: str) -> None:
    """Raises one clear line naming what is missing (CUDA, NCCL) for `what`."""
    missing = nccl_missing()
    if missing is not None:
        raise RuntimeError(f"{what}: {missing}")


def nccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """torch's NCCL backend on the current CUDA device, non-blocking, its
    communicator connected now (a failed join shows in configure, not in
    the first collective), with torch's watchdog timeout past ours."""
    require_nccl("ProcessGroupNCCL")
    backend_class = dist.ProcessGroupNCCL
    opts = backend_class.Options()
    opts.config.blocking = False
    opts._timeout = timeout * 2 + timedelta(seconds=30)
    opts.global_ranks_in_group = list(range(world_size))
    backend = backend_class(store, rank, world_size, opts)
    backend._set_sequence_number_for_group()
    backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return backend


ABORT_NCCL = (2, 25)
"""The NCCL from which ncclCommAbort of a non-blocking communicator ends
its kernels in flight (torchft's bound too)."""


def _check_abort_support() -> None:
    version = tuple(torch.cuda.nccl.version())
    if version < ABORT_NCCL:
        logger.warning(
            "NCCL %s: abort() of a collective in flight needs NCCL >= %s; with this one an "
            "abort (a timeout, a gone member) may hang instead. Use ProcessGroupBabyNCCL, "
            "whose abort kills a child process, or a torch build with a newer NCCL",
            ".".join(map(str, version)),
            ".".join(map(str, ABORT_NCCL)),
        )


def _set_nonblocking_timeout(timeout: timedelta) -> None:
    """A non-blocking communicator's setup waits TORCH_NCCL_NONBLOCKING_TIMEOUT
    (30 minutes by default) for a peer: bound it by ours, unless set."""
    name = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
    if name not in os.environ:
        os.environ[name] = str(int(max(1.0, timeout.total_seconds())))
        logger.info("%s set to %s s (this group's timeout)", name, os.environ[name])


class ProcessGroupNCCL(Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """NCCL process group that is rebuilt on every new quorum.

    `configure()` aborts the previous communicator and builds one under the
    new store prefix, on the current CUDA device (call
    `torch.cuda.set_device(local_rank)` first). A collective that does not
    finish within `timeout` aborts the communicator; `errored()` then
    reports it and the step does not commit.

    Args:
        timeout: bound on joining and on every collective.
        backend_factory: builds the backend on each configure; default real
            NCCL. Tests pass gloo's (same backend API) to run the state
            machine without a GPU.

    Raises:
        RuntimeError: (at construction, without a factory) no CUDA or no NCCL
            on this machine, in one line.
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        *,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        if backend_factory is None:
            require_nccl(type(self).__name__)
            _check_abort_support()
            _set_nonblocking_timeout(timeout)
        super().__init__(0, 1)
        self._timeout = timeout
        self._factory = backend_factory or nccl_backend
        self._backend: Any = None
        self._error: Exception | None = None
        self._rank, self._world_size = 0, 1
        self._generation = 0
        """Bumped when a communicator is dropped: its late news is not ours."""
        self._lock = threading.Lock()
        self._watchdog = Watchdog("torchft_nccl_watchdog", self._overdue)
        self._pending: dict[int, torch.futures.Future[Any]] = {}
        """Our futures not yet settled, failed at once by an abort."""
        self._next_id = 0
        self._droppers: list[threading.Thread] = []

    def set_timeout(self, timeout: timedelta) -> None:
        """Bounds the collectives issued from now on, and the next configure()."""
        self._timeout = timeout

    # ---- configure, abort --------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Joins the communicator at `store_addr` as `rank` of `world_size`;
        blocks until every member joined or `timeout` passed.

        Raises:
            RuntimeError: aborted while joining (a member is gone), or NCCL
                refused (e.g. two ranks on one GPU).
        """
        host, port, prefix = parse_store_addr(store_addr)
        self._drop(errored=False, wait_s=DROP_WAIT_S)
        with self._lock:
            generation = self._generation
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=self._timeout
        )
        backend = self._factory(dist.PrefixStore(prefix, store), rank, world_size, self._timeout)
        with self._lock:
            abandoned = generation != self._generation
            if not abandoned:
                self._backend, self._error = backend, None
                self._rank, self._world_size = rank, world_size
        if abandoned:  # a member is gone: never installed
            retired = [backend]
            del backend
            _abort_and_drop(retired)
            raise RuntimeError(f"{type(self).__name__} aborted while it was being configured")
        logger.debug("%s configured: rank %d of %d at %s", replica_id, rank, world_size, store_addr)

    def abort(self, errored: bool = True) -> None:
        """Aborts the communicator now (ncclCommAbort ends its kernels in
        flight); our futures still pending fail at once, later collectives
        raise until configure()."""
        self._drop(errored=errored, wait_s=0.0)

    def shutdown(self) -> None:
        """Aborts the communicator, stops the watchdog, and waits (bounded) for the drop."""
        self._drop(errored=False, wait_s=DROP_WAIT_S)
        self._watchdog.close()

    def _drop(self, errored: bool, wait_s: float, why: Exception | None = None) -> None:
        """Aborts and forgets the communicator; fails our pending futures with
        `why`; waits up to `wait_s` for the abort."""
        error = why or RuntimeError(
            f"{type(self).__name__} aborted; configure() builds a new communicator"
        )
        with self._lock:
            if errored and self._error is None:
                self._error = error
            # The dropper's list holds the only reference: the backend must
            # die on its thread (a gloo stand-in's waits for its collectives).
            retired = [] if self._backend is None else [self._backend]
            self._backend = None
            pending, self._pending = self._pending, {}
            self._generation += 1
        self._watchdog.clear()
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
        if retired:
            # Off this thread: the caller (the watchdog, a gone notice) must
            # not wait on an abort.
            dropper = threading.Thread(
                target=_abort_and_drop, args=(retired,), name="torchft_nccl_abort", daemon=True
            )
            dropper.start()
            self._droppers = [t for t in self._droppers if t.is_alive()] + [dropper]
        if wait_s > 0:
            # configure() and shutdown() wait (bounded) for every drop still
            # running, an earlier abort's too: the old communicator's memory
            # is back before the next is built, and no backend is still being
            # destroyed on a daemon thread when the interpreter exits.
            deadline = time.monotonic() + wait_s
            for dropper in self._droppers:
                dropper.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in self._droppers):
                logger.warning("a previous communicator's abort is still running")

    def errored(self) -> Exception | None:
        """The failure since the last configure(), once this group's
        collectives issued so far have finished on the device (a host wait,
        bounded by their timeout: the watchdog aborts them past it)."""
        self._watchdog.wait_idle(lambda: self._error is not None)
        return self._error

    # ---- issuing -----------------------------------------------------------

    def _run(self, name: str, start: Callable[[Any], dist.Work], value: Any) -> dist.Work:
        """Issues `start(backend)`; returns a Work whose future completes with
        `value` when the backend's does (CUDA-aware: a waiter's streams wait
        on the collective), or fails when the communicator is aborted."""
        with self._lock:
            backend, generation = self._backend, self._generation
            op_id, self._next_id = self._next_id, self._next_id + 1
        if backend is None:
            if self._error is not None:
                raise self._error
            raise RuntimeError(
                f"{name} before configure(): this process group has no members "
                "(configure() was not called, or it failed)"
            )
        try:
            work = start(backend)
        except Exception as e:
            self._fail(generation, e)
            raise
        out = future_for(value)
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._lock:
            if generation != self._generation:
                out.set_exception(self._error or RuntimeError(f"{name}: aborted meanwhile"))
                return FutureWork(out)
            self._pending[op_id] = out
        self._watchdog.add(Issued(name, deadline, work.is_completed, generation))

        def settle(fut: torch.futures.Future[Any]) -> None:
            with self._lock:
                mine = self._pending.pop(op_id, None) is not None
            if not mine:
                return  # aborted: failed already
            try:
                fut.value()  # a CUDA future: this callback's streams wait on it
            except Exception as e:
                out.set_exception(e)
                self._fail(generation, e)
            else:
                out.set_result(value)

        _future_of(work).add_done_callback(settle)
        return _GroupWork(out, work)

    def _fail(self, generation: int, e: Exception) -> None:
        """A collective of `generation` failed: the communicator is broken for good."""
        with self._lock:
            current = generation == self._generation
        if current:
            self._drop(
                errored=True,
                wait_s=0.0,
                why=RuntimeError(
                    f"{type(self).__name__} aborted after a failed collective ({e}); "
                    "configure() builds a new communicator"
                ),
            )

    def _overdue(self, issued: Issued) -> None:
        """The watchdog's call: `issued` did not finish within the timeout."""
        with self._lock:
            if issued.generation != self._generation:
                return  # its communicator was replaced meanwhile
        logger.error(
            "%s did not finish within %s: aborting the communicator", issued.name, self._timeout
        )
        self._drop(
            errored=True,
            wait_s=0.0,
            why=TimeoutError(
                f"{issued.name} did not finish within {self._timeout.total_seconds():g} s; "
                f"{type(self).__name__} aborted its communicator"
            ),
        )

    # ---- collectives -------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = with_reduce_op(dist.AllreduceOptions(), opts)
        return self._run("allreduce", lambda b: b.allreduce(tensors, options), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = with_reduce_op(dist.AllreduceCoalescedOptions(), opts)
        return self._run(
            "allreduce_coalesced", lambda b: b.allreduce_coalesced(tensors, options), tensors
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        return self._run(
            "allgather",
            lambda b: b.allgather(output_tensors, input_tensor, c10d.AllgatherOptions()),
            output_tensors,
        )

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        """Each output gathers its input of every rank (one backend call each)."""
        start = _pairwise("_allgather_base", output_tensors, input_tensors, c10d.AllgatherOptions())
        return self._run("allgather_into_tensor_coalesced", start, output_tensors)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> dist.Work:
        options = with_reduce_op(dist.ReduceScatterOptions(), opts)
        return self._run(
            "reduce_scatter",
            lambda b: b.reduce_scatter(output_tensors, input_tensors, options),
            output_tensors,
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        options = with_reduce_op(dist.ReduceScatterOptions(), opts)
        start = _pairwise("_reduce_scatter_base", output_tensors, input_tensors, options)
        return self._run("reduce_scatter_tensor_coalesced", start, output_tensors)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        options = opts if isinstance(opts, dist.AllToAllOptions) else dist.AllToAllOptions()
        return self._run(
            "alltoall_base",
            lambda b: b.alltoall_base(
                output_buffer, input_buffer, output_split_sizes, input_split_sizes, options
            ),
            output_buffer,
        )

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = broadcast_options(opts)
        return self._run("broadcast", lambda b: b.broadcast(tensor_list, options), tensor_list)

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts one tensor from replica rank `root`."""
        return self.broadcast([tensor], root)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", lambda b: b.barrier(dist.BarrierOptions()), None)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run("send", lambda b: b.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run("recv", lambda b: b.recv(tensors, src_rank, tag), tensors)

    alltoall = unsupported("alltoall")
    gather = unsupported("gather")
    scatter = unsupported("scatter")

    def num_active_work(self) -> int:
        """Collectives issued whose completion the watchdog has not seen yet."""
        return len(self._watchdog)

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-nccl"


def _pairwise(
    method: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], options: Any
) -> Callable[[Any], dist.Work]:
    """Issues `backend.method(output, input, options)` for each pair, read as one work."""

    def start(backend: Any) -> dist.Work:
        call = getattr(backend, method)
        return _Several([call(o, i, options) for o, i in zip(outputs, inputs, strict=True)])

    return start


def _future_of(work: Any) -> torch.futures.Future[Any]:
    """The work's future; gloo's send/recv works (the tests' stand-in) have
    none, so a helper thread waits for them."""
    try:
        return work.get_future()
    except RuntimeError:
        fut: torch.futures.Future[Any] = torch.futures.Future()

        def wait() -> None:
            try:
                work.wait()
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)

        threading.Thread(target=wait, name="torchft_nccl_p2p", daemon=True).start()
        return fut


class _GroupWork(FutureWork):
    """Our future, with the backend work's own completion: for NCCL the
    future completes when the collective is queued on the device, and
    `is_completed()` when it finished there."""

    def __init__(self, future: torch.futures.Future[Any], work: Any) -> None:
        super().__init__(future)
        self._work = work

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class _Several(dist.Work):
    """Several works issued in one call, read as one. Its future completes in
    the callback of the last of theirs to complete, on that callback's
    streams: with NCCL, one stream runs a communicator's collectives in
    order, so those streams have waited for all of them."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return all_of([_future_of(w) for w in self._works], None)


def _abort_and_drop(retired: list[Any]) -> None:
    backend = retired.pop()  # ours is now the only reference: it dies on this thread
    try:
        backend.abort()
    except Exception as e:  # an already broken communicator may refuse; drop it anyway
        logger.debug("aborting the previous communicator: %s", e)
