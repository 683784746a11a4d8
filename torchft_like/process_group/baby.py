"""ProcessGroupBabyGloo: gloo in a child process that abort() kills.

Why: gloo cannot interrupt a collective in flight (its abort and shutdown
leave it running to its timeout), so an in-process group can only abandon
one: the collective keeps its sockets and its tensors until then. Running
gloo in a child process, as pytorch/torchft's ProcessGroupBaby does, makes
abort real: killing the child closes its sockets at once (a peer that comes
back finds its collective failed) and nothing writes into our tensors after.

How, differently from torchft: the child is a plain `python -P` process
(`_baby_child.py`) that imports torch only, never re-runs the training
script as multiprocessing's spawn does; it starts (imports torch) as a warm
standby right after each configure, so the next configure does not wait for
an interpreter; and tensors are staged in shared buffers of our own (memfds
passed over the socket, reused per size), copied in when a collective is
issued and back when it completes, so the caller's tensors are never moved
to shared memory and a killed collective leaves them untouched.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_like._work import FutureWork, future_for
from torchft_like.process_group.base import (
    SUPPORTED_OPS,
    Registrable,
    broadcast_options,
    reduce_op,
    unsupported,
)
from torchft_like.process_group.gloo import (
    is_loopback,
    local_address_towards,
    parse_store_addr,
)

logger = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("_baby_child.py")
BABY_OPS = tuple(op for op in SUPPORTED_OPS if not op.startswith("reduce_scatter"))


class Child:
    """A child process running gloo and our end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(CHILD), str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.send_lock = threading.Lock()
        self._close_lock = threading.Lock()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def closed(self) -> bool:
        return self.conn.closed

    def kill(self) -> None:
        """SIGKILL (a stopped child dies too): its end of the socket closes,
        so our reader sees the end; close() ours after it has."""
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.debug("killing baby gloo child %d: %s", self.proc.pid, e)

    def close(self) -> None:
        self.kill()
        self.close_conn()

    def close_conn(self) -> None:
        """Once, whoever asks: an abort's reaper and a configure may both
        reap this child, and a second close() of the fd number would close
        whatever socket reused it (another child's: its configure hung)."""
        with self._close_lock:
            if not self.conn.closed:
                self.conn.close()


class Buffers:
    """Shared staging buffers of one child, reused by size."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.free: dict[int, list[int]] = {}

    def take(self, nbytes: int, child: Child) -> tuple[int, torch.Tensor]:
        """A buffer of `nbytes` (a new one is sent to `child`; call under its send lock)."""
        ids = self.free.get(nbytes)
        if ids:
            buf_id = ids.pop()
            return buf_id, self.tensors[buf_id]
        fd = os.memfd_create("torchft-baby-gloo")
        try:
            os.ftruncate(fd, nbytes)
            tensor = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8
            )
            buf_id = len(self.tensors)
            child.conn.send(("map", buf_id, nbytes))
            send_handle(child.conn, fd, child.proc.pid)
        finally:
            os.close(fd)
        self.tensors[buf_id] = tensor
        return buf_id, tensor

    def give_back(self, buf_id: int) -> None:
        self.free.setdefault(self.tensors[buf_id].numel(), []).append(buf_id)


@dataclass
class Op:
    future: torch.futures.Future[Any]
    value: Any
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(caller's tensor, its staged view), copied back on success."""
    buf_ids: list[int] = field(default_factory=list)
    divide_by: int | None = None
    device_buf_ids: list[int] = field(default_factory=list)
    """ProcessGroupBabyNCCL's CUDA staging buffers."""
    device_done: Any = None
    """ProcessGroupBabyNCCL: the child's event after the collective."""


def _opts(name: str, **fields: Any) -> tuple[str, str, dict[str, Any]]:
    if "reduceOp" in fields:
        op = fields["reduceOp"]
        fields["reduceOp"] = int(getattr(op, "op", op))
    return ("O", name, fields)


class ProcessGroupBabyGloo(Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """Gloo in a child process, rebuilt on every configure; `abort()` kills it.

    Collectives copy their tensors into shared buffers, the child runs them
    on gloo, and the results are copied back when they complete. A killed or
    dead child fails every collective in flight at once.

    Args:
        timeout: bound on configure (the child's start included) and on
            every collective.
        hostname: the address gloo binds (see ProcessGroupGloo).
        standby: keep a child started (torch imported) for the next
            configure; False: start one in each configure.
    """

    def __init__(
        self,
        timeout: timedelta | float = timedelta(seconds=60),
        hostname: str | None = None,
        standby: bool = True,
    ) -> None:
        super().__init__(0, 1)
        self._timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self._hostname = hostname
        self._use_standby = standby
        self._lock = threading.Lock()
        self._child: Child | None = None
        self._joining: Child | None = None
        """The child configure() is waiting on, if any."""
        self._standby: Child | None = Child() if standby else None
        self._buffers = Buffers()
        self._pending: dict[int, Op] = {}
        self._next_op = 0
        self._error: Exception | None = None
        self._rank, self._world_size = 0, 1
        self._future_thread: threading.Thread | None = None
        # torchft's tests read these two (the child and its pipe): both the child here.
        self._p: Child | None = None
        self._future_pipe: Child | None = None
        self._finalizer = weakref.finalize(self, _kill_all, [self._standby])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Kills the current child and joins the group at `store_addr` in a
        new one (the standby, if started); blocks until every member joined.

        Raises:
            TimeoutError: the child did not join within the timeout.
            RuntimeError: gloo refused (the child's error).
        """
        host, port, prefix = parse_store_addr(store_addr)
        self._drop_child(RuntimeError(f"{type(self).__name__} reconfigured"))
        child, self._standby = self._standby or Child(), None
        local = self._hostname
        if local is None and is_loopback(host):
            local = host
        elif local is None and not os.environ.get("GLOO_SOCKET_IFNAME"):
            local = local_address_towards(host, port)
        kind, device = self._child_backend()
        timeout_s = self._child_timeout_s()
        msg = ("configure", host, port, prefix, rank, world_size, timeout_s, local, kind, device)
        with self._lock:
            self._joining = child  # abort() kills it too: a member is gone
        try:
            child.conn.send(msg)
            if not child.conn.poll(self._timeout_s):
                raise TimeoutError(
                    f"{type(self).__name__} configure timed out after {self._timeout_s} seconds"
                )
            reply = child.conn.recv()
        except BaseException:
            child.close()
            raise
        finally:
            with self._lock:
                self._joining = None
        if reply is not None:
            child.close()
            raise RuntimeError(f"{type(self).__name__} configure failed in its child: {reply}")
        with self._lock:
            self._child, self._buffers, self._error = child, Buffers(), None
            self._rank, self._world_size = rank, world_size
            self._p = self._future_pipe = child
        self._future_thread = threading.Thread(
            target=self._read, args=(child,), name="torchft_baby_gloo", daemon=True
        )
        self._future_thread.start()
        if self._use_standby:
            self._standby = Child()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _kill_all, [child, self._standby])
        logger.debug("%s configured: rank %d of %d at %s", replica_id, rank, world_size, store_addr)

    # What the subclass for NCCL (baby_nccl.py) changes.

    def _child_backend(self) -> tuple[str, int | None]:
        """The child's backend and CUDA device index (none for gloo)."""
        return ("gloo", None)

    def _child_timeout_s(self) -> float:
        """The timeout of the child's own backend: gloo's is ours."""
        return self._timeout_s

    def _stage(self, x: torch.Tensor, op: Op, buffers: Buffers, child: Child) -> Any:
        """`x` copied into a shared buffer (host memory: a CUDA tensor's copy
        waits for the device); its wire form. Under the child's send lock."""
        dtype = str(x.dtype).removeprefix("torch.")
        buf_id, buf = buffers.take(x.numel() * x.element_size(), child)
        view = buf[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        view.copy_(x)
        op.staged.append((x, view))
        op.buf_ids.append(buf_id)
        return ("T", buf_id, dtype, tuple(x.shape))

    def _issued(self, op: Op) -> Any:
        """Sent with the op, after its tensors were staged (NCCL: an event)."""
        return None

    def _before_copy_back(self, op: Op, done: Any) -> None:
        """The child reported `op` done (`done`: what it sent with it)."""

    def _give_back(self, op: Op, buffers: Buffers, child: Child) -> None:
        """`op`'s buffers are free again (it finished, or its child is gone)."""
        with child.send_lock:
            for buf_id in op.buf_ids:
                buffers.give_back(buf_id)

    def _forget(self, op: Op) -> None:
        """`op` was failed because its child is gone (its shared buffers go
        with the child's; NCCL's device buffers outlive children)."""

    def abort(self, errored: bool = True) -> None:
        """Kills the child now: every collective in flight fails at once,
        later ones raise until configure()."""
        error = RuntimeError(f"{type(self).__name__} aborted: its child process was killed")
        with self._lock:
            if errored:
                self._error = self._error or error
            joining = self._joining
        if joining is not None:
            joining.proc.kill()  # its configure() sees the pipe close and raises
        self._drop_child(error, wait=False)

    def shutdown(self) -> None:
        """Kills the child and the standby; configure() starts over."""
        self._drop_child(RuntimeError(f"{type(self).__name__} shut down"))
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.close()

    def _drop_child(self, error: Exception, wait: bool = True) -> None:
        """Kills the child and fails its collectives at once; with `wait`,
        returns once it is reaped and its reader thread has ended."""
        with self._lock:
            child, pending, self._pending = self._child, self._pending, {}
        if child is not None and not child.closed():
            try:
                child.proc.kill()
            except OSError:
                pass
        for op in pending.values():
            self._forget(op)
            if not op.future.done():
                op.future.set_exception(error)
        if child is None or child.closed():
            return
        thread = self._future_thread
        if wait:
            _reap(child, thread)
        else:
            threading.Thread(
                target=_reap, args=(child, thread), name="torchft_baby_reap", daemon=True
            ).start()

    def _read(self, child: Child) -> None:
        """Completes each collective as the child reports it done."""
        while True:
            try:
                _, op_id, error, done = child.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                op = self._pending.pop(op_id, None) if child is self._child else None
            if op is None:
                continue
            self._finish(op, error, child, done)
        gone = RuntimeError(f"{type(self).__name__}: its child process is gone")
        with self._lock:
            if child is not self._child:
                return
            pending, self._pending = self._pending, {}
            self._error = self._error or gone
        for op in pending.values():
            self._forget(op)
            op.future.set_exception(gone)

    def _finish(self, op: Op, error: str | None, child: Child, done: Any = None) -> None:
        if error is None:
            self._before_copy_back(op, done)
            for tensor, staged in op.staged:
                tensor.copy_(staged)
                if op.divide_by is not None:
                    tensor.div_(op.divide_by)
        self._give_back(op, self._buffers, child)
        if error is None:
            op.future.set_result(op.value)
            return
        name = type(self).__name__
        failure = RuntimeError(f"{name} collective failed: {error}")
        with self._lock:
            self._error = self._error or RuntimeError(
                f"{name} aborted after a failed collective ({error}); configure() builds a new one"
            )
        op.future.set_exception(failure)
        # As ProcessGroupGloo: a gloo group that failed once is broken for
        # good, so the collectives still queued in the child fail now.
        self._drop_child(failure, wait=False)

    def _run(
        self, calls: list[tuple[str, list[Any]]], value: Any, divide_by: int | None = None
    ) -> dist.Work:
        """Stages the tensors of `calls` and sends them to the child as one collective."""
        with self._lock:
            child, buffers = self._child, self._buffers
            op_id, self._next_op = self._next_op, self._next_op + 1
        if child is None:
            raise RuntimeError(
                "collective before configure(): this process group has no members "
                "(configure() was not called, or it failed)"
            )
        op = Op(future_for(value), value, divide_by=divide_by)

        def stage(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if x.numel() == 0:
                    return ("T", -1, str(x.dtype).removeprefix("torch."), tuple(x.shape))
                return self._stage(x, op, buffers, child)
            if isinstance(x, list):
                return [stage(i) for i in x]
            return x

        with child.send_lock:
            wire = [(method, stage(args)) for method, args in calls]
            with self._lock:
                self._pending[op_id] = op
            try:
                child.conn.send(("op", op_id, wire, self._issued(op)))
            except BaseException:
                with self._lock:
                    self._pending.pop(op_id, None)
                raise
        self._watch(op)
        return FutureWork(op.future)

    def _watch(self, op: Op) -> None:
        """`op` was sent to the child (NCCL: its watchdog times it)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = reduce_op(opts)
        avg = op == ReduceOp.AVG  # gloo has no AVG: SUM, then divide
        options = _opts("AllreduceOptions", reduceOp=ReduceOp.SUM if avg else op)
        divide = self._world_size if avg else None
        return self._run([("allreduce", [tensors, options])], tensors, divide)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = reduce_op(opts)
        options = _opts("AllreduceCoalescedOptions", reduceOp=op)
        return self._run([("allreduce_coalesced", [tensors, options])], tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        args = [output_tensors, input_tensor, _opts("AllgatherOptions")]
        return self._run([("allgather", args)], output_tensors)

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        calls = [
            ("_allgather_base", [o, i, _opts("AllgatherOptions")])
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return self._run(calls, output_tensors)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        args = [
            output_buffer,
            input_buffer,
            list(output_split_sizes),
            list(input_split_sizes),
            _opts("AllToAllOptions"),
        ]
        return self._run([("alltoall_base", args)], output_buffer)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> dist.Work:
        torch_options = broadcast_options(opts)
        options = _opts(
            "BroadcastOptions", rootRank=torch_options.rootRank, rootTensor=torch_options.rootTensor
        )
        return self._run([("broadcast", [tensor_list, options])], tensor_list)

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts one tensor from replica rank `root`."""
        return self.broadcast([tensor], root)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run([("barrier", [_opts("BarrierOptions")])], None)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run([("send", [tensors, dst_rank, tag])], tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run([("recv", [tensors, src_rank, tag])], tensors)

    reduce_scatter = unsupported("reduce_scatter", BABY_OPS)
    reduce_scatter_tensor_coalesced = unsupported("reduce_scatter_tensor_coalesced", BABY_OPS)
    alltoall = unsupported("alltoall", BABY_OPS)
    gather = unsupported("gather", BABY_OPS)
    scatter = unsupported("scatter", BABY_OPS)

    def num_active_work(self) -> int:
        """Collectives issued and not completed yet."""
        with self._lock:
            return len(self._pending)

    def errored(self) -> Exception | None:
        """The failure since the last configure() (a collective, the child, abort), if any."""
        return self._error

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-baby-gloo"


def _reap(child: Child, reader: threading.Thread | None) -> None:
    child.kill()
    if reader is not None and reader is not threading.current_thread():
        reader.join(5.0)
    child.close_conn()


def _kill_all(children: list[Child | None]) -> None:
    """At collection or exit: no child outlives its process group."""
    for child in children:
        if child is not None and not child.closed():
            child.close()
