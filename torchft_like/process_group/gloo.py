"""ProcessGroupGloo: the gloo group rebuilt on every new quorum.

The one process group here that talks to other replica groups: where it
meets them (the store address, the interface gloo binds), how a failed
collective aborts it, and how an aborted group is dropped off the caller's
thread.
"""

# torch's stubs declare ProcessGroup's methods as overloads of the bound C++
# methods, which a Python override cannot restate.

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

from torchft_like._work import FutureWork
from torchft_like.process_group.base import (
    Registrable,
    broadcast_options,
    reduce_op,
    unsupported,
    with_reduce_op,
)
from torchft_like.process_group.gloo_work import HostStage, P2PWork, all_works, then

logger = logging.getLogger(__name__)


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_address_towards(host: str, port: int) -> str | None:
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


def _call(method: str, *args_then_backend: Any) -> dist.Work:
    """`backend.method(*args)` with the backend passed last, so that
    functools.partial can bind the arguments and `_run` the backend."""
    *args, backend = args_then_backend
    return getattr(backend, method)(*args)


class ProcessGroupGloo(Registrable, dist.ProcessGroup):  # type: ignore[misc]
    """Gloo process group that is rebuilt on every new quorum.

    `configure()` drops the previous gloo group and meets the new members in
    `PrefixStore(prefix, TCPStore(host, port))`. Every collective fails
    (instead of hanging) within `timeout` when a peer is gone, and the failure
    is kept for `errored()`.

    CUDA tensors are taken too (torchft registers gloo for `cuda` as well):
    gloo's allreduce, broadcast, allgather and alltoall run on them itself,
    the other collectives are staged through host memory (HostStage).
    Slower than NCCL, but correct, and what one GPU can run across groups.

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
        with self._lock:
            generation = self._generation
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=self._timeout
        )
        prefixed = dist.PrefixStore(prefix, store)
        local = self._hostname
        if local is None and is_loopback(host):
            # Every peer reaches the store over loopback, so all are on this
            # host: bind gloo there too rather than depend on this machine's
            # hostname resolving (it does not in some containers).
            local = host
        elif local is None and not os.environ.get("GLOO_SOCKET_IFNAME"):
            local = local_address_towards(host, port)
        if local is not None:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self._timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:  # gloo's default: GLOO_SOCKET_IFNAME, else what the hostname resolves to
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, self._timeout)
        with self._lock:
            abandoned = generation != self._generation
            if not abandoned:
                self._backend, self._error = backend, None
                self._rank, self._world_size = rank, world_size
        if abandoned:  # aborted while it joined (a member is gone): never installed
            _abort_and_drop([backend])
            raise RuntimeError("gloo process group aborted while it was being configured")
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
                target=_abort_and_drop, args=(retired,), name="torchft_gloo_abort", daemon=True
            )
            dropper.start()
            self._droppers = [t for t in self._droppers if t.is_alive()] + [dropper]

    def _run(
        self,
        name: str,
        start: Callable[[Any], dist.Work],
        p2p_tensors: list[torch.Tensor] | None = None,
        after: Callable[[], None] | None = None,
    ) -> dist.Work:
        """Issues `start(backend)`. `p2p_tensors`: the work has no future
        (gloo's send, recv, reduce_scatter), its value; `after` runs once it
        succeeded (a staged result's copy back)."""
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
            return P2PWork(work, p2p_tensors, record, after)

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
        op = reduce_op(opts)
        if op == ReduceOp.AVG:  # gloo has no AVG: SUM, then divide
            work = self._run("allreduce", lambda b: b.allreduce(tensors, dist.AllreduceOptions()))
            size = self._world_size

            def divide(_: Any) -> list[torch.Tensor]:
                for t in tensors:
                    t.div_(size)
                return tensors

            return FutureWork(then(work.get_future(), divide, tensors))
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self._run("allreduce", lambda b: b.allreduce(tensors, options))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        options = with_reduce_op(dist.AllreduceCoalescedOptions(), opts)
        stage = HostStage()
        host = stage.hosts(tensors)
        work = self._run("allreduce_coalesced", lambda b: b.allreduce_coalesced(host, options))
        return _back_to_device(work, stage, tensors)

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
        stage = HostStage()
        works = [
            self._run(
                "allgather_into_tensor_coalesced",
                functools.partial(_call, "_allgather_base", stage.host(o), stage.host(i, False)),
            )
            for o, i in zip(output_tensors, input_tensors, strict=True)
        ]
        return _back_to_device(all_works(works, output_tensors), stage, output_tensors)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> dist.Work:
        options = with_reduce_op(dist.ReduceScatterOptions(), opts)
        stage = HostStage()
        host_out = stage.hosts(output_tensors)
        host_in = [stage.hosts(ins, result=False) for ins in input_tensors]
        return self._run(
            "reduce_scatter",
            lambda b: b.reduce_scatter(host_out, host_in, options),
            output_tensors,  # gloo's reduce_scatter work has no future
            stage.copy_back,
        )

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        """Each input is summed over the ranks and split by rank (gloo: one by one)."""
        options = with_reduce_op(dist.ReduceScatterOptions(), opts)
        works = []
        for o, i in zip(output_tensors, input_tensors, strict=True):
            stage = HostStage()
            start = functools.partial(
                _call, "_reduce_scatter_base", stage.host(o), stage.host(i, False), options
            )
            # gloo's reduce_scatter work has no future
            works.append(self._run("reduce_scatter_tensor_coalesced", start, [o], stage.copy_back))
        return all_works(works, output_tensors)

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
        options = broadcast_options(opts)
        return self._run("broadcast", lambda b: b.broadcast(tensor_list, options))

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", lambda b: b.barrier(dist.BarrierOptions()))

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        host = HostStage().hosts(tensors, result=False)
        return self._run("send", lambda b: b.send(host, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        stage = HostStage()
        host = stage.hosts(tensors)
        return self._run("recv", lambda b: b.recv(host, src_rank, tag), tensors, stage.copy_back)

    alltoall = unsupported("alltoall")
    gather = unsupported("gather")
    scatter = unsupported("scatter")

    def abort(self, errored: bool = True) -> None:
        """Drops the group now (a member is gone, torchft_like.manager.gone_watch):
        later collectives raise until configure(). gloo cannot interrupt a
        collective in flight: it runs on, on the dropped group, to its
        timeout; the Manager's own futures are settled at once instead."""
        with self._lock:
            if errored and self._error is None:
                self._error = RuntimeError(
                    "gloo process group aborted; configure() builds a new one"
                )
        self._abort_backend()

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


def _back_to_device(work: dist.Work, stage: HostStage, value: Any) -> dist.Work:
    """`work`, whose staged results are copied back to the device before its
    future completes; `work` itself when nothing was staged (CPU tensors)."""
    if not stage.staged:
        return work

    def back(_: Any) -> Any:
        stage.copy_back()
        return value

    return FutureWork(then(work.get_future(), back, value))


def _abort_and_drop(retired: list[Any]) -> None:
    backend = retired.pop()  # ours is now the only reference: it dies on this thread
    try:
        backend.abort()
    except Exception as e:  # an already broken group may refuse; drop it anyway
        logger.debug("aborting the previous gloo group: %s", e)
