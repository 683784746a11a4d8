"""The ManagerServer's door to its quorum round: who gets in, and when the round may go on.

Applies admission's verdicts to the live round (refuse, take the place of
an untrusted call, hold a round that is complete only thanks to untrusted
calls) and keeps what the verdicts need: each rank's registered checkpoint
metadata and the group's last quorum's max step.
The server holds the round's waiting; the gate holds who may wait in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from torchft_like.manager.group.admission import UNTRUSTED_HOLD_S, admit
from torchft_like.manager.group.gathering import Round
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.log import GroupLog

logger = logging.getLogger(__name__)


class QuorumGate:
    """Admits the Quorum calls of one group's ranks into the current round,
    and hands each complete round to `ask` (which asks the lighthouse).

    Args:
        replica_id: the group's id, for the log.
        world_size: ranks in the group.
        metadata: group rank -> its checkpoint metadata, registered by each
            round that went to the lighthouse; shared with the server, which
            serves it to healing peers (they ask once a quorum holds the round).
        ask: the coroutine to run for each complete round.
    """

    def __init__(
        self,
        replica_id: str,
        world_size: int,
        metadata: dict[int, str],
        ask: Callable[[Round[QuorumRequest]], Coroutine[Any, Any, None]],
    ) -> None:
        self.replica_id = replica_id
        self._logger = GroupLog(logger, replica_id)
        self.world_size = world_size
        self.metadata = metadata
        self.round: Round[QuorumRequest] = Round()
        """The round new calls join."""
        self._ask = ask
        self.last_max_step: int | None = None
        """The highest step in the group's last quorum; None before its first."""
        self._logged: set[tuple[int, str]] = set()

    def join(self, rnd: Round[QuorumRequest], request: QuorumRequest, deadline: float) -> Any:
        """Adds `request` to `rnd` (the current round) and returns its future;
        a round now complete goes to the lighthouse (see when_complete).

        Raises:
            ValueError, QuorumError: the call is refused (admission.admit).
        """
        rank = request.group_rank
        waiting = rnd.calls.get(rank)
        verdict = admit(
            rank,
            request.step,
            request.checkpoint_metadata,
            self.metadata.get(rank),
            None if waiting is None else waiting.checkpoint_metadata,
            self.last_max_step,
        )
        if verdict.error is not None:
            self._log(rank, type(verdict.error).__name__, f"refused a Quorum call: {verdict.error}")
            raise verdict.error
        if verdict.displaced is not None:
            self._log(rank, "displaced", str(verdict.displaced))
            old = rnd.futures[rank]
            if not old.done():
                old.set_exception(verdict.displaced)
        future = rnd.join(rank, request, deadline)
        if verdict.trusted:
            rnd.untrusted.pop(rank, None)
        else:
            rnd.untrusted[rank] = time.monotonic()
        self.when_complete(rnd)
        return future

    def when_complete(self, rnd: Round[QuorumRequest]) -> None:
        """Starts asking for `rnd` once every rank has a call in it; a round
        complete only thanks to untrusted calls waits UNTRUSTED_HOLD_S first
        for the ranks' own."""
        if rnd is not self.round or rnd.missing(self.world_size):
            return
        since = max(rnd.untrusted.values(), default=float("-inf"))
        left_s = since + UNTRUSTED_HOLD_S - time.monotonic()
        if left_s > 0:
            asyncio.get_running_loop().call_later(left_s, self.when_complete, rnd)
            return
        self.round = Round()
        asyncio.get_running_loop().create_task(self._ask(rnd))
        if rnd.untrusted:
            self._logger.warning(
                "group ranks %s: their calls' checkpoint metadata is not what they "
                "registered; taken after %.0f s with no other caller (a rank restarted alone?)",
                sorted(rnd.untrusted),
                UNTRUSTED_HOLD_S,
            )
        for rank, call in rnd.calls.items():
            self.metadata[rank] = call.checkpoint_metadata

    def issued(self, max_step: int) -> None:
        """Notes the max step of the lighthouse's answer to the group's request."""
        self.last_max_step = max_step

    def _log(self, rank: int, kind: str, text: str) -> None:
        """WARNING the first time per rank and kind, then DEBUG: a flood of
        forged calls must not flood the log."""
        first = (rank, kind) not in self._logged and len(self._logged) < 1024
        if first:
            self._logged.add((rank, kind))
        level = logging.WARNING if first else logging.DEBUG
        self._logger.log(level, "%s", text)
