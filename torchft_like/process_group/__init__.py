"""Process groups for fault tolerance: reconfigurable, dummy and error-swallowing.

All are `torch.distributed.ProcessGroup` subclasses, so torch code (DDP
included) accepts them; torch dispatches their collectives to the Python
methods below.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_like._work import FutureWork, completed_work

logger = logging.getLogger(__name__)

SUPPORTED_OPS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_into_tensor_coalesced",
    "alltoall_base",
    "broadcast",
    "broadcast_one",
    "barrier",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "send",
    "recv",
)


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """`host:port/prefix` (prefix may hold slashes, host may be `[v6]`) to parts."""
    hostport, sep, prefix = store_addr.partition("/")
    host, colon, port = hostport.rpartition(":")
    if not sep or not prefix or not colon or not host or not port.isdigit():
        raise ValueError(
            f"store address {store_addr!r} is not host:port/prefix, "
            "e.g. 127.0.0.1:29500/torchft/3/0"
        )
    return host.strip("[]"), int(port), prefix


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_address_towards(host: str, port: int) -> str | None:
    """The address of this machine that the kernel routes to `host` from,
    or None when `host` does not resolve or has no route. A UDP connect
    only looks the route up; nothing is sent."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return None


def _reduce_op(opts: Any) -> Any:
    """The ReduceOp of `opts` (None, AllreduceOptions or a ReduceOp)."""
    if opts is None:
        return ReduceOp.SUM
    if isinstance(opts, dist.AllreduceOptions):
        return opts.reduceOp
    return opts


def _then(fut: torch.futures.Future[Any], fn: Callable[[Any], Any]) -> torch.futures.Future[Any]:
    """Like `fut.then(fn)`, but a failure of `fut` passes through unwrapped
    (`then` would bury gloo's message in a "running the callback" error)."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            result = fn(done.value())
        except Exception as e:
            out.set_exception(e)
        else:
            out.set_result(result)

    fut.add_done_callback(settle)
    return out


def _unsupported(name: str, supported: tuple[str, ...] = SUPPORTED_OPS) -> Callable[..., Any]:
    """A method that refuses `name`. NotImplementedError is a RuntimeError,
    and "does not support <op>" is what callers (torchft's tests among them)
    match to skip an op a backend lacks."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not support {name}; supported: {', '.join(supported)}"
        )

    return method


def _call(method: str, *args_then_backend: Any) -> dist.Work:
    """`backend.method(*args)` with the backend passed last, so that
    functools.partial can bind the arguments and `_run` the backend."""
    *args, backend = args_then_backend
    return getattr(backend, method)(*args)


def _all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One Work for several: done when all are, failing with the first failure."""
    futures = [w.get_future() for w in works]
    out: torch.futures.Future[Any] = torch.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle(done: torch.futures.Future[Any]) -> None:
        try:
            done.value()
        except Exception as e:
            with lock:
                if not out.done():
                    out.set_exception(e)
            return
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 and not out.done():
                out.set_result(value)

    if not futures:
        out.set_result(value)
    for fut in futures:
        fut.add_done_callback(settle)
    return FutureWork(out)


class _Registrable:
    """`register(name)` / `unregister()`: makes a Python process group known
    to torch by name, which functional collectives (and DeviceMesh) need to
    find it from C++."""

    _registered_name: str | None = None
    _registered_desc: str = "undefined"

    def register(self, name: str) -> Any:
        """Registers this group under a new group name; returns self.

        The name is torch's next group number, as for any new group, so
        `dist.get_pg_count()` counts it. `name` is its description.
        """
        from torch.distributed import distributed_c10d as c10d

        group_name = str(c10d._world.group_count)
        c10d._world.group_count += 1
        self._registered_name = group_name
        self._registered_desc = name
        c10d._register_process_group(group_name, self)  # type: ignore[arg-type]
        return self

    # torch reads a group's name and description from its C++ backends,
    # which a Python process group has none of: answer them here.
    @property
    def group_name(self) -> str:
        if self._registered_name is None:
            raise RuntimeError(
                f"{type(self).__name__} has no group name: call register(name) first"
            )
        return self._registered_name

    @property
    def group_desc(self) -> str:
        return self._registered_desc

    def unregister(self) -> None:
        """Forgets the registration of `register()`; a no-op if there is none."""
        from torch.distributed import distributed_c10d as c10d

        name = getattr(self, "_registered_name", None)
        if name is not None:
            c10d._unregister_process_group(name)
            self._registered_name = None


class ProcessGroupGloo(_Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """Gloo process group that is rebuilt on every new quorum.

    `configure()` drops the previous gloo group and meets the new members in
    `PrefixStore(prefix, TCPStore(host, port))`. Every collective fails
    (instead of hanging) within `timeout` when a peer is gone, and the failure
    is kept for `errored()`.

    Use it through the Manager: torch gives a ProcessGroup no way to change
    its C++ size, so C++ code that reads it (torch DDP given this group
    directly) sees 1; `size()` and `rank()` from Python are right.

    Args:
        timeout: bound on joining and on every collective.
        hostname: the address gloo listens on and tells peers. None: the
            interfaces in GLOO_SOCKET_IFNAME when set, else this machine's
            address on the route to the store's host (the network the
            replicas share; a machine name that resolves to 127.0.x.x, as
            on many Linux hosts, would be unreachable from other machines).
    """

    def __init__(
        self, timeout: timedelta = timedelta(seconds=60), hostname: str | None = None
    ) -> None:
        super().__init__(0, 1)
        self._timeout = timeout
        self._hostname = hostname
        self._backend: Any = None
        self._error: Exception | None = None
        self._rank, self._world_size = 0, 1
        self._generation = 0
        """Bumped when a group is dropped, so its late failures are not ours."""
        self._lock = threading.Lock()
        self._droppers: list[threading.Thread] = []

    def set_timeout(self, timeout: timedelta) -> None:
        """Bounds the collectives of the next configure() (gloo fixes a group's
        timeout when it is built)."""
        self._timeout = timeout

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Joins the group at `store_addr` as `rank` of `world_size`; blocks until
        every member has joined or `timeout` passes."""
        host, port, prefix = parse_store_addr(store_addr)
        self._abort_backend()
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=self._timeout
        )
        prefixed = dist.PrefixStore(prefix, store)
        local = self._hostname
        if local is None and _is_loopback(host):
            # Every peer reaches the store over loopback, so all are on this
            # host: bind gloo there too rather than depend on this machine's
            # hostname resolving (it does not in some containers).
            local = host
        elif local is None and not os.environ.get("GLOO_SOCKET_IFNAME"):
            local = _local_address_towards(host, port)
        if local is not None:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self._timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:  # gloo's default: GLOO_SOCKET_IFNAME, else what the hostname resolves to
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, self._timeout)
        with self._lock:
            self._backend, self._error = backend, None
            self._rank, self._world_size = rank, world_size
        logger.debug("%s configured: rank %d of %d at %s", replica_id, rank, world_size, store_addr)

    def _abort_backend(self, generation: int | None = None) -> None:
        """Drops the current group (only if still `generation`, when given)."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            retired = [] if self._backend is None else [self._backend]
            self._backend = None
            self._generation += 1
        if retired:
            # Off this thread: dropping a gloo group waits for its collectives
            # still in flight (up to `timeout`), and the peers of our next
            # configure() would time out waiting for us meanwhile.
            dropper = threading.Thread(
                target=_abort_and_drop, args=(retired,), name="torchft-gloo-abort", daemon=True
            )
            dropper.start()
            self._droppers = [t for t in self._droppers if t.is_alive()] + [dropper]

    def _run(
        self,
        name: str,
        start: Callable[[Any], dist.Work],
        p2p_tensors: list[torch.Tensor] | None = None,
    ) -> dist.Work:
        with self._lock:
            backend, generation = self._backend, self._generation
        if backend is None:
            if self._error is not None:
                raise self._error
            raise RuntimeError(
                f"{name} before configure(): this process group has no members "
                "(configure() was not called, or it failed)"
            )
        record = functools.partial(self._record_error, generation)
        try:
            work = start(backend)
        except Exception as e:
            record(e)
            raise
        if p2p_tensors is not None:  # gloo's send/recv (and reduce_scatter) work has no future
            return _P2PWork(work, p2p_tensors, record)

        def record_failure(fut: torch.futures.Future[Any]) -> None:
            try:
                fut.value()
            except Exception as e:
                record(e)

        work.get_future().add_done_callback(record_failure)
        return work

    def _record_error(self, generation: int, e: Exception) -> None:
        with self._lock:
            current = generation == self._generation
            if current and self._error is None:
                self._error = RuntimeError(
                    f"gloo process group aborted after a failed collective ({e}); "
                    "configure() builds a new one"
                )
        if current:
            # A gloo group that failed once is broken for good: drop it, so
            # the collectives still queued on it fail now, not at the timeout.
            self._abort_backend(generation)
            return
        # An aborted group's in-flight collective still runs to its timeout.
        logger.debug("ignoring a failure from a replaced gloo group: %s", e)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _reduce_op(opts)
        if op == ReduceOp.AVG:  # gloo has no AVG: SUM, then divide
            work = self._run("allreduce", lambda b: b.allreduce(tensors, dist.AllreduceOptions()))
            size = self._world_size

            def divide(_: Any) -> list[torch.Tensor]:
                for t in tensors:
                    t.div_(size)
                return tensors

            return FutureWork(_then(work.get_future(), divide))
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self._run("allreduce", lambda b: b.allreduce(tensors, options))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = dist.AllreduceCoalescedOptions()
        options.reduceOp = (
            _reduce_op(opts)
            if not isinstance(opts, dist.AllreduceCoalescedOptions)
            else opts.reduceOp
        )
        return self._run("allreduce_coalesced", lambda b: b.allreduce_coalesced(tensors, options))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        return self._run("allgather", lambda b: b.allgather(output_tensors, input_tensor))

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        """Each output gathers its input of every rank (gloo: one by one)."""
        works = [
            self._run(
                "allgather_into_tensor_coalesced",
                functools.partial(_call, "_allgather_base", o, i),
            )
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return _all_of(works, output_tensors)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> dist.Work:
        options = dist.ReduceScatterOptions()
        options.reduceOp = (
            opts.reduceOp if isinstance(opts, dist.ReduceScatterOptions) else _reduce_op(opts)
        )
        return self._run(
            "reduce_scatter",
            lambda b: b.reduce_scatter(output_tensors, input_tensors, options),
            output_tensors,  # gloo's reduce_scatter work has no future
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        """Each input is summed over the ranks and split by rank (gloo: one by one)."""
        options = dist.ReduceScatterOptions()
        options.reduceOp = (
            opts.reduceOp if isinstance(opts, dist.ReduceScatterOptions) else _reduce_op(opts)
        )
        works = [
            self._run(
                "reduce_scatter_tensor_coalesced",
                functools.partial(_call, "_reduce_scatter_base", o, i, options),
                [o],  # gloo's reduce_scatter work has no future
            )
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return _all_of(works, output_tensors)

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
        )

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts one tensor from replica rank `root`."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        return self.broadcast([tensor], options)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = opts if isinstance(opts, dist.BroadcastOptions) else dist.BroadcastOptions()
        if isinstance(opts, int):
            options.rootRank = opts
        return self._run("broadcast", lambda b: b.broadcast(tensor_list, options))

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", lambda b: b.barrier(dist.BarrierOptions()))

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._run("send", lambda b: b.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._run("recv", lambda b: b.recv(tensors, src_rank, tag), tensors)

    alltoall = _unsupported("alltoall")
    gather = _unsupported("gather")
    scatter = _unsupported("scatter")

    def errored(self) -> Exception | None:
        """The failure of a collective since the last configure(), if any."""
        return self._error

    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-gloo"

    def shutdown(self) -> None:
        """Drops the group and waits (up to `timeout`) until every dropped group
        is gone: a gloo group still being destroyed on a daemon thread when the
        interpreter exits aborts the process ("terminate called ...")."""
        self._abort_backend()
        deadline = time.monotonic() + self._timeout.total_seconds()
        for dropper in self._droppers:
            dropper.join(max(0.0, deadline - time.monotonic()))


def _abort_and_drop(retired: list[Any]) -> None:
    backend = retired.pop()  # ours is now the only reference: it dies on this thread
    try:
        backend.abort()
    except Exception as e:  # an already broken group may refuse; drop it anyway
        logger.debug("aborting the previous gloo group: %s", e)


class _P2PWork(dist.Work):
    """Gloo's send/recv work has no future: this one records a failure seen
    by wait(), and builds a future on demand from a helper thread."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor], on_error: Any) -> None:
        super().__init__()
        self._work, self._tensors, self._on_error = work, tensors, on_error
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            return self._work.wait(timeout) if timeout else self._work.wait()
        except Exception as e:
            self._on_error(e)
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                threading.Thread(target=self._settle, name="torchft-p2p", daemon=True).start()
            return self._future

    def _settle(self) -> None:
        assert self._future is not None
        try:
            self.wait()
        except Exception as e:
            self._future.set_exception(e)
        else:
            self._future.set_result(self._tensors)


class ProcessGroupDummy(_Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """Completes every collective at once without communicating.

    DDP is built over it so that its init-time parameter check and broadcast
    are absorbed: a replica can start while the others are mid-training.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__(rank, world)
        self.num_ops = 0
        """Collectives absorbed so far (tests check DDP went through here)."""
        self.configure_count = 0
        """configure() calls so far (tests check a wrapper passed them on)."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Counts the call; a dummy group has no peers to meet."""
        self.configure_count += 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _done(self, value: Any) -> dist.Work:
        self.num_ops += 1
        return completed_work(value)

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._done(tensors)

    def broadcast(self, tensor_list: Any, opts: Any = None) -> dist.Work:
        return self._done(tensor_list)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        for outputs, tensor in zip(output_tensors, input_tensor):
            for out in outputs:
                out.copy_(tensor)
        return self._done(output_tensors)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        output.copy_(
            input.reshape(-1).repeat(output.numel() // max(input.numel(), 1)).view_as(output)
        )
        return self._done(output)

    def allgather_into_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, tensor in zip(output_tensors, input_tensors):
            self._allgather_base(out, tensor)
        return self._done(output_tensors)

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, inputs in zip(output_tensors, input_tensors):
            out.copy_(inputs[0])
        return self._done(output_tensors)

    def reduce_scatter_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        for out, tensor in zip(output_tensors, input_tensors):
            out.copy_(tensor.reshape(-1)[: out.numel()].view_as(out))
        return self._done(output_tensors)

    def alltoall_base(
        self,
        output_buffer: Any,
        input_buffer: Any,
        output_split: Any,
        input_split: Any,
        opts: Any = None,
    ) -> dist.Work:
        output_buffer.copy_(input_buffer)
        return self._done(output_buffer)

    def broadcast_one(self, tensor: Any, root: int) -> dist.Work:
        return self._done(tensor)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._done(None)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-dummy"


class _ProcessGroupWrapper(dist.ProcessGroup):
    """Delegates every supported collective to `pg` through `_dispatch`."""

    def __init__(self, pg: Any) -> None:
        super().__init__(0, 1)
        self._pg = pg

    @property
    def parent(self) -> Any:
        return self._pg

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self._pg.configure(store_addr, replica_id, rank, world_size)

    def __repr__(self) -> str:
        # torchft's name for the plain wrapper, whose subclasses say their own.
        name = "ProcessGroupWrapper" if type(self) is _ProcessGroupWrapper else type(self).__name__
        return f"{name}(pg={self._pg!r})"

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        return start()

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.allreduce_coalesced(tensors, opts), tensors)

    def allgather_into_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.reduce_scatter(output_tensors, input_tensors, opts), output_tensors
        )

    def reduce_scatter_tensor_coalesced(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts),
            output_tensors,
        )

    def alltoall_base(
        self,
        output_buffer: Any,
        input_buffer: Any,
        output_split: Any,
        input_split: Any,
        opts: Any = None,
    ) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.alltoall_base(
                output_buffer, input_buffer, output_split, input_split, opts
            ),
            output_buffer,
        )

    def broadcast_one(self, tensor: Any, root: int) -> dist.Work:
        return self._dispatch(lambda: self._pg.broadcast_one(tensor, root), tensor)

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.allreduce(tensors, opts), tensors)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(
            lambda: self._pg.allgather(output_tensors, input_tensor, opts), output_tensors
        )

    def broadcast(self, tensor_list: Any, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.broadcast(tensor_list, opts), tensor_list)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._dispatch(lambda: self._pg.barrier(opts), None)

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        return self._dispatch(lambda: self._pg.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        return self._dispatch(lambda: self._pg.recv(tensors, src_rank, tag), tensors)

    def errored(self) -> Exception | None:
        return self._pg.errored() if hasattr(self._pg, "errored") else None

    def size(self) -> int:
        return self._pg.size()

    def rank(self) -> int:
        return self._pg.rank()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self._pg.getBackendName()

    def shutdown(self) -> None:
        if hasattr(self._pg, "shutdown"):
            self._pg.shutdown()


class ErrorSwallowingProcessGroupWrapper(_ProcessGroupWrapper):
    """Turns collective errors into a recorded error and completed work.

    The training loop never sees an exception from a peer's death; after the
    first error the collectives are no-ops until `configure()` is called.
    """

    def __init__(self, pg: Any) -> None:
        super().__init__(pg)
        self._error: Exception | None = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self._error = None
        super().configure(store_addr, replica_id, rank, world_size)

    def report_error(self, e: Exception) -> None:
        if self._error is None:
            logger.warning(
                "collective failed, later collectives are no-ops until reconfigured: %s", e
            )
            self._error = e

    def error(self) -> Exception | None:
        return self._error

    def errored(self) -> Exception | None:
        return self._error or super().errored()

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        if self._error is not None:
            return completed_work(default)
        try:
            work = start()
        except Exception as e:
            self.report_error(e)
            return completed_work(default)
        out: torch.futures.Future[Any] = torch.futures.Future()

        def settle(fut: torch.futures.Future[Any]) -> None:
            try:
                out.set_result(fut.value())
            except Exception as e:
                self.report_error(e)
                out.set_result(default)

        work.get_future().add_done_callback(settle)
        return FutureWork(out)


class FakeProcessGroupWrapper(_ProcessGroupWrapper):
    """Injects failures on demand, for tests of the failure paths."""

    def __init__(self, pg: Any) -> None:
        super().__init__(pg)
        self._raise_next: Exception | None = None
        self._future_error: Exception | None = None

    def fail_next_collective(self, e: Exception) -> None:
        """The next collective raises `e` when called."""
        self._raise_next = e

    def report_future_error(self, e: Exception) -> None:
        """The next collective's future completes with `e`."""
        self._future_error = e

    def _dispatch(self, start: Callable[[], dist.Work], default: Any) -> dist.Work:
        if self._raise_next is not None:
            e, self._raise_next = self._raise_next, None
            raise e
        work = start()
        if self._future_error is None:
            return work
        e, self._future_error = self._future_error, None
        failed: torch.futures.Future[Any] = torch.futures.Future()
        work.get_future().add_done_callback(lambda _: failed.set_exception(e))
        return FutureWork(failed)


class ManagedProcessGroup(_Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """A process group whose allreduce goes through `manager.allreduce`, for
    libraries that want a process group; its size is the quorum's.

    FT-HSDP uses it as the replicate dimension of FSDP2's mesh
    (`register("dp_replicate")`, then `torchft_like.device_mesh`): FSDP2's
    gradient all-reduce over that dimension (SUM or AVG) is then averaged
    over the live replica groups by the Manager.
    """

    def __init__(self, manager: Any) -> None:
        super().__init__(0, 1)
        self._manager = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if len(tensors) != 1:
            raise ValueError(f"ManagedProcessGroup.allreduce takes one tensor, got {len(tensors)}")
        # The Manager's own work, as it is: wrapping it would add a future
        # that only settles through the Manager's, so whatever holds the
        # Manager's up (or a Manager double whose work never completes)
        # would hang every wait() on ours. Its future holds the tensor.
        return self._manager.allreduce(tensors[0], reduce_op=_reduce_op(opts))

    allreduce_coalesced = _unsupported("allreduce_coalesced", ("allreduce",))
    allgather = _unsupported("allgather", ("allreduce",))
    allgather_into_tensor_coalesced = _unsupported(
        "allgather_into_tensor_coalesced", ("allreduce",)
    )
    alltoall_base = _unsupported("alltoall_base", ("allreduce",))
    broadcast = _unsupported("broadcast", ("allreduce",))
    broadcast_one = _unsupported("broadcast_one", ("allreduce",))
    barrier = _unsupported("barrier", ("allreduce",))
    reduce_scatter = _unsupported("reduce_scatter", ("allreduce",))
    reduce_scatter_tensor_coalesced = _unsupported(
        "reduce_scatter_tensor_coalesced", ("allreduce",)
    )

    def _before_first_quorum(self) -> bool:
        # FSDP2 reads rank() when fully_shard() builds the model, before the
        # training loop asks for the first quorum (the Manager's would then
        # fail: "call start_quorum() first"). Until then this group is alone.
        # A Manager double without the attribute counts as having a quorum.
        return getattr(self._manager, "_quorum_future", True) is None

    def size(self) -> int:
        if self._before_first_quorum():
            return 1
        return self._manager.num_participants()

    def rank(self) -> int:
        if self._before_first_quorum():
            return 0
        return self._manager.participating_rank() or 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-managed"


def __getattr__(name: str) -> Any:
    """torchft keeps `ft_init_device_mesh` here: it lives in
    torchft_like.device_mesh, imported on first use so that importing the
    process groups does not import DeviceMesh."""
    if name == "ft_init_device_mesh":
        from torchft_like.device_mesh import ft_init_device_mesh

        return ft_init_device_mesh
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
