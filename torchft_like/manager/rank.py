"""The Manager: the per-worker object a fault-tolerant training loop talks to.

Each step: `start_quorum()` (from Optimizer.zero_grad) asks the group's
ManagerServer for a quorum in a background thread, overlapping the forward
pass; `allreduce()` averages over the replicas of the quorum; `should_commit()`
(from Optimizer.step) applies a healed state if any, then votes. Errors in
the step path are data: the first one is recorded, later collectives of the
step become no-ops and the group votes no. Arguments and environment are
resolved in torchft_like.manager.config; a healing state is received in
torchft_like.manager.healing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import torchft_like.manager as package
from lighthouse.rpc.tls import TLSConfig
from torchft_like._work import completed_work, or_default
from torchft_like.checkpointing import CheckpointTransport
from torchft_like.collectives import InOrderCollectives
from torchft_like.data.claims import BatchClaims, BatchSlot
from torchft_like.manager import healing, parent_watch, threads
from torchft_like.manager.asking import QuorumAsk, ask_quorum
from torchft_like.manager.commit import check_retries, rank_vote
from torchft_like.manager.config import WorldSizeMode, config_arguments, resolve_config
from torchft_like.manager.fingerprint import step_fingerprint
from torchft_like.manager.gone_watch import StepBreaker
from torchft_like.manager.group.client import ManagerClientProtocol
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.metrics import ManagerMetrics
from torchft_like.manager.settling import QuorumSettlement
from torchft_like.manager.startup import (
    check_transport,
    start_rank_servers,
)
from torchft_like.manager.state_gate import StateReadGate
from torchft_like.manager.step_state import StepState
from torchft_like.manager.training_thread import TrainingThreadReads
from torchft_like.manager.user_state import UserState

logger = logging.getLogger("torchft_like.manager")

__all__ = ["Manager", "WorldSizeMode"]


class _ManagerLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        m: Manager = self.extra["manager"]  # type: ignore[index,assignment]
        return f"[{m.replica_id}/{m._group_rank} step={m._step}] {msg}", kwargs


class Manager:
    """Quorum, fault-tolerant allreduce, commit vote and live healing for one rank.

    Argument names follow pytorch/torchft's Manager. Every argument but the
    four objects below is a field of `ManagerConfig` (torchft_like.
    manager.config), which documents it and the environment variable that
    sets it when the argument is not given: torchrun's MASTER_ADDR,
    MASTER_PORT, RANK and WORLD_SIZE, and TORCHFT_LIGHTHOUSE,
    TORCHFT_MANAGER_PORT, TORCHFT_HOSTNAME, TORCHFT_BIND_HOST, the
    TORCHFT_*_SEC timeouts and TORCHFT_QUORUM_RETRIES (these two win over
    arguments), TORCHFT_SECRET_FILE / TORCHFT_SECRET, TORCHFT_TLS_*,
    TORCHFT_METRICS_PORT, TORCHFT_HEAL_SOURCES, TORCHFT_JOB_ID. `config` holds
    them resolved. Timeouts take a timedelta or a number of seconds.

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
        job_id: str | None = None,
    ) -> None:
        # First, while the locals are the arguments.
        config = resolve_config(environ=os.environ, **config_arguments(locals()))
        self.config = config
        """Every argument and variable, resolved (torchft_like.manager.config)."""
        check_transport(checkpoint_transport, config.secret, config.tls)
        if config.exit_with_parent:
            parent_watch.exit_with_parent()
        # Names torchft's Manager has, which its tests and our wrappers read.
        self._fingerprint_fn = fingerprint_fn
        self._pg = pg
        self._use_async_quorum = config.use_async_quorum
        self._timeout = config.timeout
        self._init_sync = config.init_sync
        self._group_rank = config.rank
        self._user_state = UserState()
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._errored: Exception | None = None
        self._claims = BatchClaims()
        self._quorum_future: Future[None] | None = None
        self._training_thread = TrainingThreadReads()
        self._collectives_ready = self._training_thread.event()
        """Set once this step's quorum is applied and any healing transfer
        has begun at its source (or the quorum failed): a healing replica's
        collectives wait for no more, so its state arrives while its
        backward pass and allreduces run. A source serves a begun transfer
        until it ends, and it cannot finish its own allreduce, and so step,
        before ours has begun."""
        self._collectives = InOrderCollectives()
        self._step_state = StepState()
        self._commit_hooks: list[Callable[[], None]] = []
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="torchft_quorum",
            initializer=threads.start_quorum_thread,
            initargs=(config.control_sched == "batch",),
        )
        self._lock = threading.Lock()
        self._state_read_gate = StateReadGate(self._timeout.total_seconds())
        self.replica_id = config.replica_id
        self._logger = _ManagerLogger(logger, {"manager": self})
        self.metrics = ManagerMetrics(self.replica_id, self._group_rank)
        """This rank's Prometheus metrics (torchft_like.manager.metrics)."""

        started = start_rank_servers(
            config, pg, checkpoint_transport, self.metrics, package.ManagerClient, self._logger
        )
        self._store = started.store
        self._checkpoint_transport = started.checkpoint_transport
        self._manager_server = started.manager_server
        self.replica_id = started.replica_id
        self._client: ManagerClientProtocol = started.client
        self._metrics_server = started.metrics_server
        self._gone = StepBreaker(
            config,
            self._store,
            self.replica_id,
            self._manager_server,
            self._collectives,
            pg,
            self._logger,
        )
        self._settled = QuorumSettlement(
            config,
            self.replica_id,
            self._claims,
            self._gone,
            self._checkpoint_transport,
            self._training_thread,
            self.metrics,
            self._logger,
            self._metadata_of,
            self.full_state_dict,
            self.report_error,
            self._collectives_ready,
        )
        """This step's quorum as applied off the training thread (manager.settling)."""
        self._logger.info("manager ready, server %s", started.manager_address)

    # ---- state -------------------------------------------------------------

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds a piece of user state that healing copies from a live peer."""
        self._user_state.register(key, load_state_dict, state_dict)

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
        self._user_state.load(state["user"])  # a missing key: ValueError, nothing loaded
        self.load_state_dict(state["torchft"])

    def full_state_dict(self) -> dict[str, Any]:
        """Everything healing copies: every registered state dict ("user")
        and our progress ("torchft"); durable checkpoints save it."""
        return {"user": self._user_state.state_dicts(), "torchft": self.state_dict()}

    # ---- quorum ------------------------------------------------------------

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Begins the step: asks for a quorum, in the background when async."""
        threads.check(threads.TRAINING, what="Manager.start_quorum")
        if self._quorum_future is not None:
            self.wait_quorum()
        if self._settled.fatal is not None:
            raise self._settled.fatal
        self._errored = None
        self._settled.healing = False
        self._gone.new_step()
        self._step_state = StepState(started=time.monotonic())
        state_fingerprint = step_fingerprint(
            self._step,
            self.config.fingerprint_interval,
            self._state_read_gate.allowed,
            self._fingerprint_fn or (lambda: self.full_state_dict()["user"]),
            self._logger,
        )
        self._collectives_ready.clear()
        batch_slot = self._claims.take()
        ask = QuorumAsk(
            step=self._step,
            step_state=self._step_state,
            request=lambda: self._quorum_request(
                shrink_only=shrink_only, state_fingerprint=state_fingerprint, batch_slot=batch_slot
            ),
            timeout=timeout or self.config.quorum_timeout,
            allow_heal=allow_heal,
            every_member_counts=allow_heal and not self._use_async_quorum,
            started=time.monotonic(),
        )
        self._quorum_future = ask_quorum(
            ask,
            client=self._client,
            settle=self._settled.settle,
            quorum_id=lambda: self._settled.quorum_id,
            executor=self._executor,
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
            if self._step_state.quorum_error is None and self._step_state.quorum_max_step > 0:
                return
        if not self._use_async_quorum or (self._init_sync and self._step == 0):
            self.wait_quorum()
            if not self._use_async_quorum and self._step_state.quorum_error is not None:
                # Synchronous callers get it here, as from torchft (recorded: no commit).
                raise self._step_state.quorum_error
            if self._settled.healing and self._errored is None:
                self._apply_pending_state_dict()

    def wait_quorum(self) -> None:
        """Blocks until the quorum of this step is known and healing state received."""
        threads.check(threads.TRAINING, what="Manager.wait_quorum")
        assert self._quorum_future is not None, "call start_quorum() first"
        self._training_thread.wait(self._quorum_future.done)
        self._quorum_future.result()

    def _wait_collectives_ready(self) -> None:
        """Blocks until this step's quorum is known and any healing transfer
        has begun (should_commit waits for it to end)."""
        assert self._quorum_future is not None, "call start_quorum() first"
        self._training_thread.wait(self._collectives_ready.is_set)

    def _quorum_request(
        self, shrink_only: bool, state_fingerprint: str, batch_slot: int | None
    ) -> QuorumRequest:
        return QuorumRequest(
            group_rank=self._group_rank,
            step=self._step,
            checkpoint_metadata=self._checkpoint_transport.metadata(),
            shrink_only=shrink_only,
            init_sync=self._init_sync,
            commit_failures=self._commit_failures,
            fingerprint=state_fingerprint,
            heal_report=self._settled.heal_report,
            batch_slot=batch_slot,
        )

    def _metadata_of(self, manager_address: str) -> str:
        return healing.ask_metadata(
            package.ManagerClient, manager_address, self._group_rank, self.config, self._timeout
        )

    def _apply_pending_state_dict(self) -> None:
        assert self._step_state.pending_state_dict is not None, "healing without a received state"
        state, self._step_state.pending_state_dict = self._step_state.pending_state_dict, None
        self.load_full_state_dict(state)  # a key the source lacks: a ValueError naming it
        self._settled.healing = False
        self._logger.info("healed: loaded the live state at step %d", self._step)

    # ---- collectives -------------------------------------------------------

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
        *,
        in_place: bool = False,
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
            in_place: gloo reduces `tensor` itself instead of a private copy
                (one pass less), divided first as torch DDP does; an
                allreduce abandoned when a member is gone may then write
                into it later, so the caller must never use its memory
                again once `abandoned()` has grown (DDP's buckets).

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
        if self._settled.participating_rank is None:
            tensor.zero_()
        divide_by = self._settled.num_participants if reduce_op == ReduceOp.AVG else None
        quantize = should_quantize and torch.is_floating_point(tensor)
        work = self._collectives.allreduce(
            tensor, self._pg, quantize, divide_by, self.report_error, in_place
        )
        self._step_state.pending_work.append(work)
        return work

    def abandoned(self) -> int:
        """How many `in_place` tensors were left to abandoned collectives so far."""
        return self._collectives.abandoned

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
        threads.check(threads.TRAINING, what="Manager.should_commit")
        self.wait_quorum()
        if self._settled.fatal is not None:
            raise self._settled.fatal
        if self._settled.healing and self._errored is None:
            try:
                self._apply_pending_state_dict()
            except Exception as e:
                self.report_error(e)
        for hook in self._commit_hooks:
            hook()
        for work in self._step_state.pending_work:
            work.wait()  # never raises: wrap_future recorded any error
        self._step_state.pending_work.clear()
        self._checkpoint_transport.disallow_checkpoint()
        pg_error = self._pg.errored() if hasattr(self._pg, "errored") else None
        if pg_error is not None:
            self.report_error(pg_error)
        self._gone.check_frozen(self.report_error)
        vote, too_few = rank_vote(
            self._errored is not None,
            self._settled.healing,
            self._settled.num_participants,
            self.config.min_replica_size,
        )
        if too_few:
            self._logger.info("%s", too_few)
        vote_error: Exception | None = None
        try:
            decision = self._client.should_commit(
                self._group_rank, self._step, vote, timeout or self._timeout
            )
        except Exception as e:
            self.report_error(e)
            decision, vote_error = False, e
        if decision:
            self._step += 1
            self._batches_committed += self._settled.num_participants
            self._commit_failures = 0
        else:
            self._commit_failures += 1
        self.metrics.record_step(decision, self._step, time.monotonic() - self._step_state.started)
        if not decision:
            self._logger.info("step not committed (%d in a row)", self._commit_failures)
            if vote_error is not None and not self._use_async_quorum:
                raise vote_error  # synchronous callers get it, as from torchft
            check_retries(self._commit_failures, self.config.max_retries, self._errored)
        return decision

    # ---- what the training loop reads -------------------------------------

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        """Units of data (one group's batch each) trained by committed steps:
        the participants of each committed step, summed; StepBatches' cursor."""
        return self._batches_committed

    def num_participants(self) -> int:
        """Replicas that count in this step's collectives; 0 before the
        first quorum (torchtitan's checkpointer asks after every step)."""
        if self._quorum_future is None:
            return 0
        self._wait_collectives_ready()
        return self._settled.num_participants

    def participating_rank(self) -> int | None:
        """Our rank among this step's participants; None when we do not
        count (healing) or before the first quorum."""
        if self._quorum_future is None:
            return None
        self._wait_collectives_ready()
        return self._settled.participating_rank

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def quorum_id(self) -> int:
        return self._settled.quorum_id

    # torchft's names, which its tests and our wrappers read (and set)
    @property
    def _quorum_id(self) -> int:
        return self._settled.quorum_id

    @property
    def _healing(self) -> bool:
        return self._settled.healing

    @_healing.setter
    def _healing(self, healing: bool) -> None:
        self._settled.healing = healing

    def did_heal(self) -> bool:
        """Whether this step's quorum made us copy the state from a peer."""
        return self._step_state.healed

    def is_serving_state(self) -> bool:
        """Whether this step's quorum made us serve our state to a healing
        peer. The transfer reads the live tensors until should_commit, so a
        caller that writes them before (DiLoCo's inner steps while a sync is
        in flight) waits for the peer first."""
        self.wait_quorum()
        return self._step_state.serving

    def metrics_address(self) -> str | None:
        """`http://host:port/metrics` of this rank's metrics, or None when not served."""
        return self._metrics_server.address() if self._metrics_server else None

    def timings(self) -> dict[str, float]:
        """Seconds spent on this step's quorum (`quorum_s`), and on receiving a
        healing state (`heal_recv_s`) when there was one."""
        return dict(self._step_state.timings)

    # ---- data ---------------------------------------------------------------

    def claim_batch_slot(self) -> BatchSlot:
        """Our participating rank next step, forecast from the last quorum,
        claimed in the next quorum request (torchft_like.data.claims):
        StepBatches trains unit `batches_committed() + slot`."""
        participating = (self._settled.num_participants, self._settled.participating_rank)
        return self._claims.claim(self._commit_failures == 0, participating)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the servers and unblocks every background wait."""
        self._client.close()
        self._gone.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self._manager_server is not None:
            self._manager_server.shutdown()
        self._checkpoint_transport.shutdown(wait=wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._collectives.shutdown()
        if hasattr(self._pg, "shutdown"):
            self._pg.shutdown()
