"""A quorum's answer applied to one rank, off the training thread.

Settling runs on the quorum thread, or on group rank 0's server loop for a
steady answer (manager.asking, manager.threads). It decides whether and
where the rank counts, configures the process group for a new quorum, and
serves or receives the state a heal moves. The training thread reads what
it settled (`quorum_id`, `num_participants`, `participating_rank`,
`healing`) once the `ready` event is set; the Manager holds the rest of the
step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lighthouse.core.views import QuorumResult
from lighthouse.rpc.errors import DuplicateGroupError, IncompatibleGroupError, QuorumError
from torchft_like.checkpointing import CheckpointTransport
from torchft_like.checkpointing.heal_source import stripe_cap
from torchft_like.checkpointing.staging import streams_done
from torchft_like.checkpointing.transport import capable
from torchft_like.data.claims import BatchClaims
from torchft_like.manager import healing, threads
from torchft_like.manager.config import ManagerConfig, WorldSizeMode
from torchft_like.manager.gone_watch import MemberGoneError, StepBreaker
from torchft_like.manager.heal_plan import participation, transfer_plan
from torchft_like.manager.metrics import ManagerMetrics
from torchft_like.manager.training_thread import TrainingThreadReads

if TYPE_CHECKING:
    from torchft_like.manager.asking import QuorumAsk, ResultOf


class QuorumSettlement:
    """One rank's settled quorum, and the work of settling the next.

    Args:
        metadata_of: a source's checkpoint metadata from its manager address.
        read_state: the state a healing peer copies (read on the training
            thread, through `training_thread`).
        report_error: records an error of the step (Manager.report_error).
        ready: set once the answer is applied and any heal has begun.
    """

    def __init__(
        self,
        config: ManagerConfig,
        replica_id: str,
        claims: BatchClaims,
        gone: StepBreaker,
        transport: CheckpointTransport[Any],
        training_thread: TrainingThreadReads,
        metrics: ManagerMetrics,
        log: logging.LoggerAdapter[logging.Logger],
        metadata_of: Callable[[str], str],
        read_state: Callable[[], Any],
        report_error: Callable[[Exception], None],
        ready: threading.Event,
    ) -> None:
        self._config = config
        self._replica_id = replica_id
        self._claims = claims
        self._gone = gone
        self._transport = transport
        self._training_thread = training_thread
        self._metrics = metrics
        self._log = log
        self._metadata_of = metadata_of
        self._read_state = read_state
        self._report_error = report_error
        self._ready = ready
        self.quorum_id = -1
        self.num_participants = 0
        self.participating_rank: int | None = None
        self.healing = False
        """This step copies the state from a peer (applied in should_commit)."""
        self.heal_report = ""
        """JSON of the last heal, sent with the next quorum request (lighthouse.core.heals)."""
        self.fatal: DuplicateGroupError | IncompatibleGroupError | None = None
        """An error that no retry can fix: raised by the next start_quorum/should_commit."""

    def settle(self, ask: QuorumAsk, result_of: ResultOf) -> None:
        """Applies `result_of()`, the answer to `ask`; a failure is the step's error."""
        step_state = ask.step_state
        try:
            result = result_of()
            self.heal_report = ""
            step_state.timings["quorum_s"] = time.monotonic() - ask.started
            self._metrics.quorum_seconds.observe(step_state.timings["quorum_s"])
            self._apply(result, ask)
        except (DuplicateGroupError, IncompatibleGroupError) as e:
            self._log.error("quorum refused, stopping: %s", e)
            self.fatal = e
            self._report_error(e)
        except Exception as e:
            # A QuorumError is expected when peers or the lighthouse fail: no traceback.
            expected = isinstance(e, (QuorumError, MemberGoneError))
            log = self._log.warning if expected else self._log.exception
            log("quorum failed: %s", e)
            step_state.quorum_error = e
            self._report_error(e)
        finally:
            self._ready.set()

    def _apply(self, result: QuorumResult, ask: QuorumAsk) -> None:
        config = self._config
        step_state, every_member_counts = ask.step_state, ask.every_member_counts
        allow_heal = ask.allow_heal  # off below when the step cannot commit
        spares = config.world_size_mode == WorldSizeMode.FIXED_WITH_SPARES
        cap = config.min_replica_size if spares else None
        self.num_participants, self.participating_rank = participation(
            result, every_member_counts=every_member_counts, max_participants=cap
        )
        wrong = self._claims.verdict(result, cap, every_member_counts)
        if wrong is not None:
            self._report_error(wrong)
            # Every replica reads the same: none serves or heals for a step
            # that cannot commit (a healer would wait for a source gone by).
            allow_heal = False
        self._metrics.record_quorum(result.quorum_id, self.num_participants)
        if result.quorum_id != self.quorum_id:
            threads.check(threads.QUORUM, what="configuring the process group")
            store = f"{result.store_address}/torchft/{result.quorum_id}/{config.rank}"
            self._log.info(
                "reconfiguring for quorum %d: replica rank %d of %d, store %s",
                result.quorum_id,
                result.replica_rank,
                result.replica_world_size,
                store,
            )
            rank, size = result.replica_rank, result.replica_world_size
            self._gone.join(result.quorum_id, store, self._replica_id, rank, size)
            self.quorum_id = result.quorum_id
        self._gone.quorum_applied(result.quorum_id)
        transport = self._transport
        plan = transfer_plan(
            result, stripe_cap(capable(transport, "can_stripe"), config.heal_sources)
        )
        if allow_heal and plan.serve_to:
            step_state.serving = True
            self._log.info("serving state to replica ranks %s", list(plan.serve_to))
            # Read by the training thread (manager.training_thread): no gate,
            # it cannot be writing the state while it waits on us; its CUDA
            # streams finish writing it there (a transport's copies run here).
            state = self._training_thread.read(
                lambda: streams_done(self._read_state()), config.timeout.total_seconds()
            )
            transport.send_checkpoint(list(plan.serve_to), ask.step, state, config.timeout)
        step_state.quorum_max_step = result.max_step
        if not (allow_heal and result.heal):
            self._ready.set()
            return
        self.healing = step_state.healed = True
        threads.check(threads.QUORUM, what="receiving a healing state")
        heal = healing.receive_state(
            transport, result, plan, config.timeout, self._metadata_of, self._ready.set, self._log
        )
        step_state.pending_state_dict = heal.state
        step_state.timings["heal_recv_s"] = heal.seconds
        self.heal_report = heal.report
        self._metrics.record_heal(heal.num_bytes, heal.seconds)
