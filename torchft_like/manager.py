"""The Manager: the per-worker object a fault-tolerant training loop talks to.

Each step: `start_quorum()` (from Optimizer.zero_grad) asks the group's
ManagerServer for a quorum in a background thread, overlapping the forward
pass; `allreduce()` averages over the replicas of the quorum; `should_commit()`
(from Optimizer.step) applies a healed state if any, then votes. Errors in
the step path are data: the first one is recorded, later collectives of the
step become no-ops and the group votes no. Arguments and environment are
resolved in torchft_like.manager_config; a healing state is received in
torchft_like.healing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp, TCPStore

from lighthouse.rpc.address import join_host_port, loopback_advertisement_warning
from lighthouse.rpc.errors import DuplicateGroupError, IncompatibleGroupError, QuorumError
from lighthouse.rpc.tls import TLSConfig
from torchft_like import healing, parent_watch
from torchft_like._state_gate import StateReadGate
from torchft_like._training_thread import TrainingThreadReads
from torchft_like._work import FutureWork, completed_work, or_default
from torchft_like.checkpointing import CheckpointTransport, HTTPTransport
from torchft_like.checkpointing._http_fetch import GONE_AFTER_S
from torchft_like.collectives import InOrderCollectives, allreduce_quantized
from torchft_like.fingerprint import fingerprint
from torchft_like.group_quorum import QuorumRequest
from torchft_like.manager_client import ManagerClient, ManagerClientProtocol
from torchft_like.manager_config import WorldSizeMode, resolve_config
from torchft_like.manager_server import LocalManagerClient, ManagerServer
from torchft_like.metrics import ManagerMetrics
from torchft_like.process_group import ProcessGroupDummy
from torchft_like.recovery import QuorumResult, transfer_plan

logger = logging.getLogger(__name__)

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"

__all__ = ["MANAGER_ADDR_KEY", "REPLICA_ID_KEY", "Manager", "WorldSizeMode"]


class _ManagerLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        m: Manager = self.extra["manager"]  # type: ignore[index,assignment]
        return f"[{m.replica_id}/{m._group_rank} step={m._step}] {msg}", kwargs


class Manager:
    """Quorum, fault-tolerant allreduce, commit vote and live healing for one rank.

    Argument names follow pytorch/torchft's Manager. Every argument but the
    four objects below is a field of `ManagerConfig` (torchft_like.
    manager_config), which documents it and the environment variable that
    sets it when the argument is not given: torchrun's MASTER_ADDR,
    MASTER_PORT, RANK and WORLD_SIZE, and TORCHFT_LIGHTHOUSE,
    TORCHFT_MANAGER_PORT, TORCHFT_HOSTNAME, TORCHFT_BIND_HOST, the
    TORCHFT_*_SEC timeouts and TORCHFT_QUORUM_RETRIES (these two win over
    arguments), TORCHFT_SECRET_FILE / TORCHFT_SECRET, TORCHFT_TLS_*,
    TORCHFT_METRICS_PORT and TORCHFT_HEAL_SOURCES. `config` holds them
    resolved. Timeouts take a timedelta or a number of seconds.

    Args:
        pg: reconfigurable process group for the cross-replica allreduce.
        load_state_dict, state_dict: the user state to heal, registered as
            "default" (more with `register_state_dict_fn`).
        checkpoint_transport: how healing state travels (HTTPTransport,
            which must have the Manager's secret and TLS configuration).
        fingerprint_fn: returns what `fingerprint_interval` compares
            (tensors, nested in dicts/lists), e.g. `model.parameters` or a
            state dict without buffers that replicas keep apart on purpose.
            None: the state that healing copies (every registered state dict).

    Raises:
        ValueError: an invalid argument or variable (ManagerConfigError
            names it and what to set), or a checkpoint_transport whose
            secret or TLS differs from the Manager's.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        timeout: timedelta | float = timedelta(seconds=60),
        quorum_timeout: timedelta | float = timedelta(seconds=60),
        connect_timeout: timedelta | float = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        fingerprint_interval: int | None = None,
        fingerprint_fn: Callable[[], Any] | None = None,
        secret: str | None = None,
        tls: TLSConfig | None = None,
        exit_with_parent: bool = True,
        metrics_port: int | None = None,
        heal_sources: int | None = None,
    ) -> None:
        config = resolve_config(
            min_replica_size=min_replica_size, use_async_quorum=use_async_quorum,
            timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout,
            rank=rank, world_size=world_size, world_size_mode=world_size_mode,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse_addr,
            replica_id=replica_id, port=port, hostname=hostname,
            heartbeat_interval=heartbeat_interval, init_sync=init_sync,
            max_retries=max_retries, quorum_retries=quorum_retries,
            fingerprint_interval=fingerprint_interval, secret=secret, tls=tls,
            exit_with_parent=exit_with_parent, metrics_port=metrics_port,
            heal_sources=heal_sources, environ=os.environ,
        )  # fmt: skip
        self.config = config
        """Every argument and variable, resolved (torchft_like.manager_config)."""
        _check_transport(checkpoint_transport, config.secret, config.tls)
        if config.exit_with_parent:
            parent_watch.exit_with_parent()
        # Names torchft's Manager has, which its tests and our wrappers read.
        self._fingerprint_fn = fingerprint_fn
        self._pg = pg
        self._use_async_quorum = config.use_async_quorum
        self._timeout = config.timeout
        self._init_sync = config.init_sync
        self._group_rank = config.rank
        self._user_state: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._errored: Exception | None = None
        self._fatal: DuplicateGroupError | IncompatibleGroupError | None = None
        """An error that no retry can fix: raised by the next start_quorum/should_commit."""
        self._healing = False
        self._pending_state_dict: dict[str, Any] | None = None
        self._participating_rank: int | None = None
        self._num_participants = 0
        self._quorum_future: Future[None] | None = None
        self._training_thread = TrainingThreadReads()
        self._collectives_ready = self._training_thread.event()
        """Set once this step's quorum is applied and any healing transfer
        has begun at its source (or the quorum failed): a healing replica's
        collectives wait for no more, so its state arrives while its
        backward pass and allreduces run. A source serves a begun transfer
        until it ends, and it cannot finish its own allreduce, and so step,
        before ours has begun."""
        self._quorum_max_step = 0
        self._quorum_error: Exception | None = None
        """Why this step's quorum failed, if it did."""
        self._pending_work: list[dist.Work] = []
        self._collectives = InOrderCollectives()
        self._healed = False
        self._serving = False
        self._timings: dict[str, float] = {}
        self._step_started = 0.0
        self._heal_report = ""
        """JSON of the last heal, sent with the next quorum request (lighthouse.heals)."""
        self._commit_hooks: list[Callable[[], None]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchft_quorum")
        self._lock = threading.Lock()
        self._state_read_gate = StateReadGate(self._timeout.total_seconds())
        self.replica_id = config.replica_id
        self._logger = _ManagerLogger(logger, {"manager": self})
        self.metrics = ManagerMetrics(self.replica_id, self._group_rank)
        """This rank's Prometheus metrics (torchft_like.metrics)."""

        self._store = TCPStore(
            config.store_addr,
            config.store_port,
            is_master=False,
            wait_for_workers=False,
            timeout=self.config.connect_timeout,
        )
        listen_host = config.bind_host or config.hostname
        self._checkpoint_transport = checkpoint_transport or HTTPTransport(
            timeout=self._timeout,
            hostname=config.hostname,
            secret=self.config.secret,
            bind_host=config.bind_host,
            tls=self.config.tls,
        )
        self._manager_server: ManagerServer | None = None
        prefix = config.store_prefix
        if self._group_rank == 0:
            assert config.lighthouse_addr is not None  # resolve_config requires it on rank 0
            warning = loopback_advertisement_warning(config.hostname, config.lighthouse_addr)
            if warning:
                self._logger.warning("%s", warning)
            full_id = f"{self.replica_id}:{uuid.uuid4()}"
            self._manager_server = ManagerServer(
                replica_id=full_id,
                lighthouse_addr=config.lighthouse_addr,
                hostname=config.hostname,
                bind=join_host_port(listen_host, config.port),
                store_addr=join_host_port(config.store_addr, config.store_port),
                world_size=self.config.world_size,
                heartbeat_interval=config.heartbeat_interval,
                connect_timeout=self.config.connect_timeout,
                quorum_retries=config.quorum_retries,
                secret=self.config.secret,
                tls=self.config.tls,
                local_collectives=isinstance(pg, ProcessGroupDummy),
            )
            self._store.set(prefix + MANAGER_ADDR_KEY, self._manager_server.address())
            self._store.set(prefix + REPLICA_ID_KEY, full_id)
        manager_addr = self._store.get(prefix + MANAGER_ADDR_KEY).decode()
        self.replica_id = self._store.get(prefix + REPLICA_ID_KEY).decode()
        self._client: ManagerClientProtocol = (
            LocalManagerClient(self._manager_server)
            if self._manager_server is not None
            else ManagerClient(
                manager_addr, self.config.connect_timeout, self.config.secret, self.config.tls
            )
        )
        # Last, so a failed start leaves no server behind.
        self._metrics_server = (
            self.metrics.serve(listen_host, config.metrics_port)
            if config.metrics_port is not None
            else None
        )
        self._logger.info("manager ready, server %s", manager_addr)

    # ---- state -------------------------------------------------------------

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds a piece of user state that healing copies from a live peer."""
        if key in self._user_state:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._user_state[key] = (load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Registers the user state after construction, as training platforms
        do once their checkpointer exists; the same as passing the functions
        to the constructor (key "default").

        Raises:
            ValueError: state is already registered under "default".
        """
        self.register_state_dict_fn("default", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Ends a `disallow_state_dict_read`; idempotent."""
        self._state_read_gate.allow()

    def disallow_state_dict_read(self) -> None:
        """Marks our state as being written in place (torchft's API). The
        state served to a healing peer is read on the training thread, which
        cannot be writing it then; while disallowed, only the state
        fingerprint is skipped. Idempotent; undo with `allow_state_dict_read`.
        """
        self._state_read_gate.disallow()

    @property
    def _is_state_dict_read_allowed(self) -> bool:  # torchft's name, read by its tests
        return self._state_read_gate.allowed

    def register_commit_hook(self, hook: Callable[[], None]) -> None:
        """Runs `hook` in should_commit, after a healed state is applied and
        before the vote, on every replica in the same order. DDP syncs module
        buffers here, so a healed replica ends the step with the same buffers."""
        self._commit_hooks.append(hook)

    def state_dict(self) -> dict[str, int]:
        """The manager's own progress, saved and restored with user checkpoints."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a `full_state_dict()`, e.g. from a durable checkpoint or a
        healing source (torchft's or ours)."""
        missing = sorted(set(self._user_state) - set(state["user"]))
        if missing:
            raise ValueError(
                f"the state has no {missing} (registered with register_state_dict_fn; it "
                f"holds {sorted(state['user'])}): register the same keys on every replica and "
                "as when it was saved (torchft's set_state_dict_fns names its state "
                "'set_state_dict_fns'; ours and both Manager constructors: 'default')"
            )
        for key, (load, _) in self._user_state.items():
            load(state["user"][key])
        self.load_state_dict(state["torchft"])

    def full_state_dict(self) -> dict[str, Any]:
        """Everything healing copies: every registered state dict ("user")
        and our progress ("torchft"); durable checkpoints save it."""
        return {
            "user": {key: fns[1]() for key, fns in self._user_state.items()},
            "torchft": self.state_dict(),
        }

    # ---- quorum ------------------------------------------------------------

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Begins the step: asks for a quorum, in the background when async."""
        if self._quorum_future is not None:
            self.wait_quorum()
        if self._fatal is not None:
            raise self._fatal
        self._errored = None
        self._healing = False
        self._healed = False
        self._serving = False
        self._pending_work = []
        self._step_started = time.monotonic()
        state_fingerprint = self._take_fingerprint()
        self._collectives_ready.clear()
        self._quorum_future = self._executor.submit(
            self._async_quorum,
            allow_heal,
            shrink_only,
            timeout or self.config.quorum_timeout,
            state_fingerprint,
        )
        self._quorum_future.add_done_callback(lambda _: self._training_thread.wake())
        # A replica of a fresh job (every replica at step 0) may receive the
        # initial weights (init_sync): applying them before the forward pass
        # makes its first gradient valid, so every replica counts from the
        # first step. One that joins a job already past step 0 (a restart, a
        # spare) contributes zeros this step anyway, so like any replica
        # behind it receives the state while its backward pass runs.
        if self._init_sync and self._step == 0 and self._use_async_quorum:
            self._wait_collectives_ready()
            if self._quorum_error is None and self._quorum_max_step > 0:
                return
        if not self._use_async_quorum or (self._init_sync and self._step == 0):
            self.wait_quorum()
            if not self._use_async_quorum and self._quorum_error is not None:
                # Synchronous callers get the failure where they asked, as
                # from torchft; it is also recorded, so the step cannot commit.
                raise self._quorum_error
            if self._healing and self._errored is None:
                self._apply_pending_state_dict()

    def wait_quorum(self) -> None:
        """Blocks until the quorum of this step is known and healing state received."""
        assert self._quorum_future is not None, "call start_quorum() first"
        self._training_thread.wait(self._quorum_future.done)
        self._quorum_future.result()

    def _wait_collectives_ready(self) -> None:
        """Blocks until this step's quorum is known and any healing transfer
        has begun (should_commit waits for it to end)."""
        assert self._quorum_future is not None, "call start_quorum() first"
        self._training_thread.wait(self._collectives_ready.is_set)

    def _take_fingerprint(self) -> str:
        """Every `fingerprint_interval` committed steps, a fingerprint of our
        state for this step's quorum to carry to the other replicas. Taken
        here because the state is final (the optimizer stepped after the last
        commit; this step's forward pass, which may update buffers, has not
        begun). Each rank sends its own: ranks of one group need not hold the
        same state, and rank r is compared with rank r of the other groups."""
        interval = self.config.fingerprint_interval
        if interval is None or self._step == 0 or self._step % interval:
            return ""
        if not self._state_read_gate.allowed:  # being written: compare another step
            return ""
        try:
            fn = self._fingerprint_fn
            value = fingerprint(fn() if fn else self.full_state_dict()["user"])
        except Exception as e:
            self._logger.exception("fingerprint failed, not comparing this step: %s", e)
            return ""
        self._logger.debug("state fingerprint %s", value)
        return value

    def _async_quorum(
        self, allow_heal: bool, shrink_only: bool, timeout: timedelta, state_fingerprint: str = ""
    ) -> None:
        start = time.monotonic()
        self._timings = {}
        self._quorum_error = None
        try:
            request = QuorumRequest(
                group_rank=self._group_rank,
                step=self._step,
                checkpoint_metadata=self._checkpoint_transport.metadata(),
                shrink_only=shrink_only,
                init_sync=self._init_sync,
                commit_failures=self._commit_failures,
                fingerprint=state_fingerprint,
                heal_report=self._heal_report,
            )
            result = self._client.quorum(request, timeout)
            self._heal_report = ""
            self._timings["quorum_s"] = time.monotonic() - start
            self.metrics.quorum_seconds.observe(self._timings["quorum_s"])
            self._apply_quorum(result, allow_heal)
        except (DuplicateGroupError, IncompatibleGroupError) as e:
            self._logger.error("quorum refused, stopping: %s", e)
            self._fatal = e
            self.report_error(e)
        except QuorumError as e:  # expected when peers or the lighthouse fail: no traceback
            self._logger.warning("quorum failed: %s", e)
            self._quorum_error = e
            self.report_error(e)
        except Exception as e:
            self._logger.exception("quorum failed: %s", e)
            self._quorum_error = e
            self.report_error(e)
        finally:
            self._collectives_ready.set()

    def _apply_quorum(self, result: QuorumResult, allow_heal: bool) -> None:
        self._set_participation(result, allow_heal)
        self.metrics.quorum_id.set(result.quorum_id)
        self.metrics.participants.set(self._num_participants)
        if result.quorum_id != self._quorum_id:
            store = f"{result.store_address}/torchft/{result.quorum_id}/{self._group_rank}"
            self._logger.info(
                "reconfiguring for quorum %d: replica rank %d of %d, store %s",
                result.quorum_id,
                result.replica_rank,
                result.replica_world_size,
                store,
            )
            self._pg.configure(
                store, self.replica_id, result.replica_rank, result.replica_world_size
            )
            self._quorum_id = result.quorum_id
        transport = self._checkpoint_transport
        plan = transfer_plan(result, self.config.heal_sources if transport.can_stripe else 1)
        if allow_heal and plan.serve_to:
            self._serving = True
            self._logger.info("serving state to replica ranks %s", list(plan.serve_to))
            # Read by the training thread (see _training_thread): no gate, it
            # cannot be writing the state while it waits on us.
            state = self._training_thread.read(self.full_state_dict, self._timeout.total_seconds())
            transport.send_checkpoint(list(plan.serve_to), self._step, state, self._timeout)
        self._quorum_max_step = result.max_step
        if not (allow_heal and result.heal):
            self._collectives_ready.set()
        if allow_heal and result.heal:
            self._healing = self._healed = True
            heal = healing.receive_state(
                transport, result, plan, self._timeout, self._metadata_of,
                self._collectives_ready.set, self._logger,
            )  # fmt: skip
            self._pending_state_dict = heal.state
            self._timings["heal_recv_s"] = heal.seconds
            self._heal_report = heal.report
            self.metrics.heals.inc()
            self.metrics.heal_bytes.inc(heal.num_bytes)
            self.metrics.heal_seconds.observe(heal.seconds)

    def _metadata_of(self, manager_address: str) -> str:
        # The source asked for this quorum moments ago, so it was listening;
        # one that refuses connections for a second (GONE_AFTER_S) has died
        # since: fail the heal (the next quorum leaves it out) rather than
        # wait the whole connect timeout.
        connect = min(self.config.connect_timeout, timedelta(seconds=GONE_AFTER_S))
        src = ManagerClient(manager_address, connect, self.config.secret, self.config.tls)
        try:
            return src.checkpoint_metadata(self._group_rank, self._timeout)
        finally:
            src.close()

    def _set_participation(self, result: QuorumResult, allow_heal: bool) -> None:
        """Replicas at max_step count; every replica derives the same count
        from the quorum. One behind heals this step and contributes zeros (at
        max_step 0 the init_sync healing is applied before the forward pass,
        see start_quorum, so those replicas count). With a synchronous quorum
        every replica of the quorum counts, as in torchft: a replica that
        heals has its state before the forward pass (start_quorum)."""
        if self._use_async_quorum or not allow_heal:
            count, rank = result.max_world_size, result.max_replica_rank
        else:
            count, rank = result.replica_world_size, result.replica_rank
        if self.config.world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
            count = min(count, self.config.min_replica_size)
            if rank is not None and rank >= count:
                rank = None
        self._num_participants = count
        self._participating_rank = rank

    def _apply_pending_state_dict(self) -> None:
        assert self._pending_state_dict is not None, "healing without a received state"
        state, self._pending_state_dict = self._pending_state_dict, None
        self.load_full_state_dict(state)  # a key the source lacks: a ValueError naming it
        self._healing = False
        self._logger.info("healed: loaded the live state at step %d", self._step)

    # ---- collectives -------------------------------------------------------

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> dist.Work:
        """Sums `tensor` over the quorum in place and, for AVG, divides by the
        number of participating replicas. A replica that is healing or a spare
        contributes zeros. Never raises: an error is recorded and the step
        will not commit.

        Args:
            tensor: reduced in place.
            should_quantize: send the floating point tensor as blockwise
                int8 (torchft_like.collectives.allreduce_quantized): about a
                quarter of the bytes, lossy (each element within about
                1/127 of its block's largest magnitude), still bit-identical
                on every replica. DiLoCo uses it for pseudo-gradients.
                torchft quantizes to fp8 only on CUDA; we do it on any device.
            reduce_op: SUM or AVG (SUM, then divide by num_participants()).

        Raises:
            ValueError: AVG of a tensor that is not floating point (the
                division would truncate); use ReduceOp.SUM.
        """
        if reduce_op == ReduceOp.AVG and not torch.is_floating_point(tensor):
            raise ValueError(
                f"ReduceOp.AVG of a {tensor.dtype} tensor would truncate the division by "
                "num_participants(); pass a floating point tensor or reduce_op=ReduceOp.SUM"
            )
        if self._errored is not None:
            return completed_work(tensor)
        self._wait_collectives_ready()
        if self._errored is not None:
            return completed_work(tensor)
        if self._participating_rank is None:
            tensor.zero_()
        num_participants = self._num_participants
        try:
            quantize = should_quantize and torch.is_floating_point(tensor)
            pg = self._pg
            work = self._collectives.issue(
                (lambda: allreduce_quantized(tensor, pg))
                if quantize
                else (lambda: pg.allreduce([tensor], ReduceOp.SUM)),
                two_rounds=quantize,
            )

            def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
                # wrap_future's contract in one callback (one future less
                # per bucket): an error is recorded, the value is the tensor.
                try:
                    fut.value()
                    if reduce_op == ReduceOp.AVG:
                        tensor.div_(num_participants)
                except Exception as e:
                    self.report_error(e)
                return tensor

            managed = FutureWork(work.get_future().then(finish))
            self._pending_work.append(managed)
            return managed
        except Exception as e:
            self.report_error(e)
            return completed_work(tensor)

    def wrap_future(
        self, fut: torch.futures.Future[Any], default: Any, timeout: timedelta | None = None
    ) -> torch.futures.Future[Any]:
        """Turns a failing (or, with `timeout`, late) future into `default`,
        recording the error so the step does not commit."""
        return or_default(fut, default, self.report_error, timeout)

    def report_error(self, e: Exception) -> None:
        """Records the first error of the step; the step will not commit."""
        with self._lock:
            if self._errored is None:
                self._errored = e
                self._logger.warning("step error, this step will not commit: %s", e)

    def errored(self) -> Exception | None:
        return self._errored

    # ---- commit ------------------------------------------------------------

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Votes with the whole group; True means every rank may step.

        Applies a pending healed state first, and stops serving our state so
        the optimizer can write the weights.

        Raises:
            RuntimeError: `max_retries` consecutive uncommitted steps.
            IncompatibleGroupError: this group's process group cannot
                rendezvous with the job's other groups (another torchft
                release); they train on without it.
            DuplicateGroupError: the lighthouse refused this group because
                another live group has the same name; retrying cannot help.
        """
        self.wait_quorum()
        if self._fatal is not None:
            raise self._fatal
        if self._healing and self._errored is None:
            try:
                self._apply_pending_state_dict()
            except Exception as e:
                self.report_error(e)
        for hook in self._commit_hooks:
            hook()
        for work in self._pending_work:
            work.wait()  # never raises: wrap_future recorded any error
        self._pending_work = []
        self._checkpoint_transport.disallow_checkpoint()
        pg_error = self._pg.errored() if hasattr(self._pg, "errored") else None
        if pg_error is not None:
            self.report_error(pg_error)
        enough = self._num_participants >= self.config.min_replica_size
        vote = self._errored is None and enough and not self._healing
        if self._errored is None and not enough:
            self._logger.info(
                "too few replicas to commit: %d < min_replica_size %d",
                self._num_participants,
                self.config.min_replica_size,
            )
        vote_error: Exception | None = None
        try:
            decision = self._client.should_commit(
                self._group_rank, self._step, vote, timeout or self._timeout
            )
        except Exception as e:
            self.report_error(e)
            decision, vote_error = False, e
        self.metrics.step_seconds.observe(time.monotonic() - self._step_started)
        if decision:
            self._step += 1
            self._batches_committed += self._num_participants
            self._commit_failures = 0
            self.metrics.committed_steps.inc()
            self.metrics.step.set(self._step)
        else:
            self._commit_failures += 1
            self.metrics.commit_failures.inc()
            self._logger.info("step not committed (%d in a row)", self._commit_failures)
            if vote_error is not None and not self._use_async_quorum:
                raise vote_error  # synchronous callers get it, as from torchft
            if (
                self.config.max_retries is not None
                and self._commit_failures > self.config.max_retries
            ):
                raise RuntimeError(
                    f"{self._commit_failures} steps in a row failed to commit, more than "
                    f"max_retries={self.config.max_retries}; last error: {self._errored}"
                )
        return decision

    # ---- introspection -----------------------------------------------------

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        """Replicas that count in this step's collectives; 0 before the
        first quorum (torchtitan's checkpointer asks after every step)."""
        if self._quorum_future is None:
            return 0
        self._wait_collectives_ready()
        return self._num_participants

    def participating_rank(self) -> int | None:
        """Our rank among this step's participants; None when we do not
        count (healing) or before the first quorum."""
        if self._quorum_future is None:
            return None
        self._wait_collectives_ready()
        return self._participating_rank

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def quorum_id(self) -> int:
        return self._quorum_id

    def did_heal(self) -> bool:
        """Whether this step's quorum made us copy the state from a peer."""
        return self._healed

    def is_serving_state(self) -> bool:
        """Whether this step's quorum made us serve our state to a healing
        peer. The transfer reads the live tensors until should_commit, so a
        caller that writes them before (DiLoCo's inner steps while a sync is
        in flight) waits for the peer first."""
        self.wait_quorum()
        return self._serving

    def metrics_address(self) -> str | None:
        """`http://host:port/metrics` of this rank's metrics, or None when not served."""
        return self._metrics_server.address() if self._metrics_server else None

    def timings(self) -> dict[str, float]:
        """Seconds spent on this step's quorum (`quorum_s`), and on receiving a
        healing state (`heal_recv_s`) when there was one."""
        return dict(self._timings)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the servers and unblocks every background wait."""
        self._client.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self._manager_server is not None:
            self._manager_server.shutdown()
        self._checkpoint_transport.shutdown(wait=wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._collectives.shutdown()
        if hasattr(self._pg, "shutdown"):
            self._pg.shutdown()


def _check_transport(
    transport: CheckpointTransport | None, secret: str | None, tls: TLSConfig | None
) -> None:
    """A given HTTPTransport must share the Manager's secret and TLS, or peers cannot fetch."""
    if not isinstance(transport, HTTPTransport):
        return
    if transport.secret != secret:
        raise ValueError(
            "checkpoint_transport's secret differs from the Manager's (TORCHFT_SECRET_FILE "
            "or TORCHFT_SECRET): pass HTTPTransport(..., secret=...) the same secret, or "
            "the peers cannot fetch from each other"
        )
    if transport.tls != tls:
        raise ValueError(
            "checkpoint_transport's TLS configuration differs from the Manager's "
            "(TORCHFT_TLS_*): pass HTTPTransport(..., tls=...) the same TLSConfig"
        )
