"""The lighthouse server: gRPC service, waiting callers and the tick loop.

All state lives on one asyncio loop (no locks). Each RPC is an event of the
membership state machine (lighthouse.membership), which decides; this module
reads the clock, keeps each waiting call's future under its ticket, and acts
on the effects: answers calls, logs, updates metrics and feeds the status
page's memory (lighthouse.status_view).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from grpc import aio

from lighthouse import kill_button, wire
from lighthouse.effects import (
    AdviceChanged,
    DecideSoon,
    Effect,
    Fail,
    Handed,
    Issued,
    Log,
    Outcome,
    Placed,
)
from lighthouse.gone import Gone
from lighthouse.membership import Membership
from lighthouse.metrics import LighthouseMetrics
from lighthouse.quorum import LighthouseConfig, Quorum, QuorumMember
from lighthouse.rpc import auth, errors, serve
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.errors import DuplicateGroupError, QuorumError, QuorumTimeoutError
from lighthouse.rpc.loop import BackgroundLoop, reply_budget_s, wait_within
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, scheme
from lighthouse.state_file import StateFile, log_start
from lighthouse.status import StatusServer
from lighthouse.status_view import StatusView

logger = logging.getLogger(__name__)

DECIDE_COST_FACTOR = 10
"""A call-triggered decision waits for 10x the previous one's cost (see decide_soon)."""


class _Coordinator:
    """The shell around lighthouse.membership: the clock, the waiting calls'
    futures, the metrics and the status page's memory, all on one loop."""

    def __init__(
        self, config: LighthouseConfig, metrics: LighthouseMetrics, state: StateFile | None
    ) -> None:
        self.metrics = metrics
        self.state = state
        restored = state.restored if state is not None else None
        self.membership = Membership(config, time.monotonic(), restored)
        self.view = StatusView(self.membership)
        self.quorums: dict[int, asyncio.Future[Quorum]] = {}
        """ticket -> the future of a waiting Quorum call."""
        self.answer_now: dict[int, Callable[[bytes], None]] = {}
        """ticket -> a waiting Quorum call's way to answer at once (Coordinator.join)."""
        self._response: tuple[Quorum | None, bytes] = (None, b"")
        self.spares: dict[int, asyncio.Future[str]] = {}
        """ticket -> the future of a waiting TakeReplicaGroup call."""
        self.outboxes: dict[str, set[asyncio.Queue[pb.LighthouseHeartbeatAdvice]]] = {}
        """replica_id -> the outboxes of its HeartbeatPaced streams (gone notices)."""
        self._decide_soon: asyncio.Handle | None = None
        """The decision pending (decide_soon)."""
        self._decided_at = 0.0
        """perf_counter seconds when the last call-triggered decision ended."""
        self._decide_cost_s = 0.0
        """How long that decision took."""
        metrics.heartbeat_advice.set(self.membership.advice_ms / 1000)

    def apply(self, outcome: Outcome, now: float) -> None:
        """Acts on an event's effects; raises the calling RPC's refusal."""
        if outcome.effects:
            wall = time.time()
            for effect in outcome.effects:
                self._act(effect)
            self.view.observe(outcome.effects, now, wall)
            if any(isinstance(e, Issued) for e in outcome.effects):
                goodput = self.view.progress.job_goodput()
                if goodput is not None:
                    self.metrics.goodput.set(goodput)
            if any(isinstance(e, DecideSoon) and e.now for e in outcome.effects):
                # Every replica waits: decide in this turn of the loop, so the
                # last caller's answer is ready when its handler goes on.
                self._decide_now()
        if outcome.error is not None:
            raise outcome.error

    def _act(self, effect: Effect) -> None:
        if isinstance(effect, Issued):
            self._issued(effect)
        elif isinstance(effect, Fail):
            future = self.quorums.pop(effect.ticket, None)
            if future is not None and not future.done():
                future.set_exception(effect.error)
        elif isinstance(effect, Placed):
            spare = self.spares.pop(effect.ticket, None)
            if spare is not None and not spare.done():
                spare.set_result(effect.group)
            self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
        elif isinstance(effect, Handed):
            if effect.promotion:
                self.metrics.spare_promotions.inc()
            logger.info(
                "%s %s trains as replica group %s%s",
                "spare" if effect.promotion else "process",
                effect.spare_id,
                effect.group,
                " (its replicas died)" if effect.promotion else "",
            )
        elif isinstance(effect, Log):
            logger.log(effect.level, effect.msg, *effect.args)
        elif isinstance(effect, DecideSoon) and not effect.now:
            self.decide_soon()
        elif isinstance(effect, AdviceChanged):
            self.metrics.heartbeat_advice.set(effect.advice_ms / 1000)
        elif isinstance(effect, Gone):
            notice = effect.notice
            message = pb.LighthouseHeartbeatAdvice(
                interval_ms=self.membership.advice_ms,
                gone=pb.LighthouseGoneNotice(quorum_id=notice.quorum_id, replica_ids=notice.gone),
            )
            for rid in notice.recipients:
                for outbox in self.outboxes.get(rid, ()):
                    outbox.put_nowait(message)

    def _issued(self, issued: Issued) -> None:
        quorum = issued.quorum
        self.metrics.on_quorum(quorum)
        # A new quorum is news, and so is the end of a logged stall; the
        # same members again (every step) is not.
        level = logging.INFO if issued.news else logging.DEBUG
        if logger.isEnabledFor(level):  # the member list costs O(members) to format
            logger.log(
                level,
                "quorum %d issued (%s): %s",
                quorum.quorum_id,
                issued.reason,
                ", ".join(f"{m.replica_id} step={m.step}" for m in quorum.participants),
            )
        if self.state is not None:  # before any caller hears of it (lighthouse.state_file)
            self.state.issued(time.monotonic(), quorum, self.membership.high_water_step)
        for ticket in issued.tickets:
            answer_now = self.answer_now.pop(ticket, None)
            if answer_now is not None:  # the answers go out in one tight loop
                answer_now(self.quorum_response(quorum))
            future = self.quorums.pop(ticket, None)
            if future is not None and not future.done():
                future.set_result(quorum)

    def heartbeat(self, replica_id: str) -> None:
        """Raises DuplicateGroupError for a second live replica of one group."""
        now = time.monotonic()
        self.apply(self.membership.heartbeat(now, replica_id), now)
        self.metrics.heartbeats.inc()

    def join(
        self, member: QuorumMember, answer_now: Callable[[bytes], None] | None = None
    ) -> tuple[int, asyncio.Future[Quorum]]:
        """Registers a Quorum call; its future gets the first issued quorum
        that contains `member`, and `answer_now` (lean_server's, if given)
        its serialized answer in the same turn. The caller must `withdraw`
        it when done."""
        now = time.monotonic()
        outcome = self.membership.join(now, member)
        future: asyncio.Future[Quorum] = asyncio.get_running_loop().create_future()
        if outcome.error is None:
            self.quorums[outcome.ticket] = future
            if answer_now is not None:
                self.answer_now[outcome.ticket] = answer_now
        self.apply(outcome, now)  # may issue a quorum to `future` already
        return outcome.ticket, future

    def quorum_response(self, quorum: Quorum) -> bytes:
        """Converts and serializes each issued quorum once: every member's call
        returns the same bytes (decode_guard passes bytes through), where
        doing either per call is O(members^2) a step."""
        if self._response[0] is not quorum:
            response = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_proto(quorum))
            self._response = (quorum, response.SerializeToString())
        return self._response[1]

    def withdraw(self, replica_id: str, ticket: int) -> None:
        self.quorums.pop(ticket, None)
        self.answer_now.pop(ticket, None)
        self.membership.withdraw(replica_id, ticket)

    def leave(self, replica_id: str) -> None:
        now = time.monotonic()
        self.apply(self.membership.leave(now, time.time(), replica_id), now)

    def stream_opened(self, replica_id: str, outbox: asyncio.Queue[Any] | None) -> None:
        """A heartbeat stream opened; `outbox` (HeartbeatPaced) gets its notices."""
        self.membership.stream_opened(replica_id)
        if outbox is not None:
            self.outboxes.setdefault(replica_id, set()).add(outbox)

    def stream_ended(self, replica_id: str, outbox: asyncio.Queue[Any] | None) -> None:
        boxes = self.outboxes.get(replica_id)
        if boxes is not None and outbox is not None:
            boxes.discard(outbox)
            if not boxes:
                del self.outboxes[replica_id]
        now = time.monotonic()
        self.apply(self.membership.stream_ended(now, replica_id), now)

    async def take_replica_group(self, spare_id: str, wanted: str) -> str:
        """Waits until the caller may train as a replica group; returns its name."""
        now = time.monotonic()
        outcome = self.membership.spare_waits(now, spare_id, wanted)
        if outcome.error is not None:
            raise outcome.error
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.spares[outcome.ticket] = future
        self.metrics.spares_waiting.set(self.membership.num_spares_waiting())
        self.apply(outcome, now)
        try:
            return await asyncio.shield(future)
        finally:
            if self.spares.pop(outcome.ticket, None) is not None:
                self.membership.spare_ends(outcome.ticket)
                self.metrics.spares_waiting.set(self.membership.num_spares_waiting())

    def decide_soon(self) -> None:
        """Decides once for all the calls that arrive meanwhile. A decision
        costs O(replicas), so deciding per call is O(replicas^2) a step; the
        next one waits until 10x the last one's cost has passed, which keeps
        decisions under ~10% of the loop (20 us with 2 replicas, ~10 ms with
        a thousand)."""
        if self._decide_soon is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._decided_at + DECIDE_COST_FACTOR * self._decide_cost_s - time.perf_counter()
        if wait > 0:
            self._decide_soon = loop.call_later(wait, self._decide_now)
        else:
            self._decide_soon = loop.call_soon(self._decide_now)

    def _decide_now(self) -> None:
        if self._decide_soon is not None:
            self._decide_soon.cancel()
            self._decide_soon = None
        if self.membership.participants:
            start = time.perf_counter()
            now = time.monotonic()
            outcome = self.membership.decide(now, time.time())
            self._decide_cost_s = time.perf_counter() - start  # answers sent are not its cost
            self.apply(outcome, now)
            self._decided_at = time.perf_counter()

    def tick(self) -> None:
        now = time.monotonic()
        self.apply(self.membership.tick(now, time.time()), now)
        if self.state is not None:
            self.state.flush(now)
        self.metrics.healthy_replicas.set(len(self.membership.healthy(now)))

    def snapshot(self) -> dict[str, Any]:
        return self.view.snapshot(time.monotonic(), time.time())


class _LighthouseServicer:
    """LighthouseService, registered by its method names. Thin: converts,
    calls the coordinator, converts back, maps errors (lighthouse.rpc.errors)."""

    def __init__(self, coordinator: _Coordinator) -> None:
        self._coord = coordinator

    async def Quorum(
        self, request: pb.LighthouseQuorumRequest, context: aio.ServicerContext[Any, Any]
    ) -> bytes:
        start = time.monotonic()
        budget_s = reply_budget_s(context.time_remaining())
        try:
            member = wire.quorum_request_from_proto(request)
            ticket, future = self._coord.join(member, getattr(context, "answer_now", None))
            # The future itself, with a timer that fails it: its answer wakes
            # this call in one turn of the loop (wait_for takes two, each as
            # long as the burst of calls at a step boundary: ~45 ms at 300 groups).
            timer = None
            if budget_s is not None:
                timer = asyncio.get_running_loop().call_later(
                    budget_s, self._expire, future, member.replica_id, budget_s
                )
            try:
                quorum = await future
            finally:
                if timer is not None:
                    timer.cancel()
                self._coord.withdraw(member.replica_id, ticket)
        except Exception as e:
            await errors.abort(context, e)
        self._coord.metrics.quorum_latency.observe(time.monotonic() - start)
        return self._coord.quorum_response(quorum)

    def _expire(self, future: asyncio.Future[Any], replica_id: str, budget_s: float) -> None:
        """A Quorum call's deadline came first: it is told what was missing."""
        if not future.done():
            membership = self._coord.membership
            error = errors.FreshStartRefusedError if membership.refused_fresh_start else None
            future.set_exception(
                (error or QuorumTimeoutError)(
                    f"no quorum containing {replica_id} within {budget_s:.1f} s: "
                    f"{membership.reason}"
                )
            )

    async def Heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseHeartbeatResponse:
        if not request.replica_id:
            await errors.abort(context, ValueError("replica_id must be a non-empty string"))
        try:
            self._coord.heartbeat(request.replica_id)
        except DuplicateGroupError as e:
            await errors.abort(context, e)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatStream(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseHeartbeatResponse:
        await self._heartbeats(request_iterator, context, advise=False)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatPaced(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any]
    ) -> None:
        """HeartbeatStream that answers with the period to heartbeat at
        (lighthouse.pacing): on the first heartbeat and after each change."""
        await self._heartbeats(request_iterator, context, advise=True)

    async def _heartbeats(
        self, request_iterator: Any, context: aio.ServicerContext[Any, Any], advise: bool
    ) -> None:
        replica_id = ""
        advised = 0
        # One writer per stream: the advice from here, gone notices from the
        # coordinator (lighthouse.gone), as soon as they are decided.
        outbox: asyncio.Queue[pb.LighthouseHeartbeatAdvice] | None = None
        writer: asyncio.Task[None] | None = None
        if advise:
            outbox = asyncio.Queue()
            writer = asyncio.get_running_loop().create_task(_write_all(context, outbox))
        try:
            async for request in request_iterator:
                if request.replica_id != replica_id:
                    if not request.replica_id:
                        await errors.abort(
                            context, ValueError("replica_id must be a non-empty string")
                        )
                    if replica_id:
                        await errors.abort(
                            context,
                            ValueError(
                                f"one heartbeat stream carries one replica_id: got "
                                f"{request.replica_id!r} after {replica_id!r}; open a stream each"
                            ),
                        )
                    replica_id = request.replica_id
                    self._coord.stream_opened(replica_id, outbox)
                try:
                    self._coord.heartbeat(replica_id)
                except DuplicateGroupError as e:
                    await errors.abort(context, e)
                if outbox is not None and advised != self._coord.membership.advice_ms:
                    advised = self._coord.membership.advice_ms
                    outbox.put_nowait(pb.LighthouseHeartbeatAdvice(interval_ms=advised))
        finally:
            if writer is not None:
                writer.cancel()
            # Also on cancellation: the client's connection closed under us.
            if replica_id:
                self._coord.stream_ended(replica_id, outbox)

    async def TakeReplicaGroup(
        self, request: pb.TakeReplicaGroupRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.TakeReplicaGroupResponse:
        """The group to train as, or "" when the call's deadline comes first
        (the caller asks again: a spare may wait for hours)."""
        try:
            group = await wait_within(
                self._coord.take_replica_group(request.spare_id, request.wanted),
                reply_budget_s(context.time_remaining()),
                lambda: QuorumTimeoutError("no group yet"),
            )
        except QuorumTimeoutError:
            group = ""
        except Exception as e:
            await errors.abort(context, e)
        return pb.TakeReplicaGroupResponse(replica_group=group)

    async def Leave(
        self, request: pb.LighthouseLeaveRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.LighthouseLeaveResponse:
        if not request.replica_id:
            await errors.abort(context, ValueError("replica_id must be a non-empty string"))
        self._coord.leave(request.replica_id)
        return pb.LighthouseLeaveResponse()


class LighthouseServer:
    """A lighthouse running in the background of the calling process.

    Starts in the constructor; `address()` is its `http://host:port` URL and
    `shutdown()` is idempotent. Quorum ids start at the wall clock in
    milliseconds and never go below it (see `next_quorum_id`), so a restarted
    lighthouse never repeats an id without persisting any state. With a
    `secret`, every call must carry it (lighthouse.rpc.auth); None: open to all.
    With `tls`, it serves TLS (lighthouse.rpc.tls) and its address is https://.
    With `kill_button` (and a secret), the status page has a kill form per
    replica (see `kill`); off by default, as the page is open to all readers.

    Args:
        bind: `host:port` to listen on (port 0 picks one).
        min_replicas: fewest replica groups a quorum may have.
        join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms, suspect_phi, suspect_min_ms: the
            quorum rule's options (lighthouse.quorum.LighthouseConfig).
        http_bind: `host:port` of the status page and /metrics; None: no page.
        secret: the job's shared secret, or None.
        tls: serve TLS with this configuration, or None for plaintext.
        kill_button: offer a kill form per replica on the status page.
        state_file: keep the job's high-water mark and last quorum in this
            file across restarts (lighthouse.state_file); None: in memory only.
        allow_fresh_start: let groups all at step 0 train although the job
            already committed steps (lighthouse.quorum.fresh_start_refusal).

    Raises:
        ValueError: a bad option or an unparsable bind address.
        OSError: the port is already in use.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int = 60000,
        quorum_tick_ms: int = 100,
        heartbeat_timeout_ms: int = 5000,
        http_bind: str | None = None,
        secret: str | None = None,
        suspect_phi: float = 8.0,
        suspect_min_ms: int = 700,
        tls: TLSConfig | None = None,
        kill_button: bool = False,
        state_file: str | None = None,
        allow_fresh_start: bool = False,
        rpc_server: str = "lean",
    ) -> None:
        if tls is not None:
            tls.require_server("lighthouse")
        self.config = LighthouseConfig(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            suspect_phi=suspect_phi,
            suspect_min_ms=suspect_min_ms,
            allow_fresh_start=allow_fresh_start,
        )
        host, port = parse_bind(bind)
        self.metrics = LighthouseMetrics()
        self._state = StateFile(state_file) if state_file else None
        self._coord = _Coordinator(self.config, self.metrics, self._state)
        self._loop = BackgroundLoop("lighthouse")
        self._http = None
        self._stopped = False
        self._secret = secret
        self._tls = tls
        self._kill_button = kill_button
        self._rpc_server = rpc_server
        try:
            self._port = self._loop.run(self._start(host, port))
            self._host = advertised_host(host)
            if http_bind is not None:
                self._http = StatusServer(http_bind, self.status, self.metrics.render, self.kill)
        except BaseException:
            self.shutdown()
            raise
        logger.info("lighthouse listening on %s (gRPC, bind %s)", self.address(), bind)
        logger.info("access control: %s", "on (shared secret)" if secret else "off (no secret)")
        logger.info("transport: %s", _describe(tls))
        log_start(self._state, allow_fresh_start)
        warning = auth.exposure_warning(secret, host, "lighthouse")
        if warning:
            logger.warning("%s", warning)

    async def _start(self, host: str, port: int) -> int:
        self._server = serve.new_server(
            pb_grpc.add_LighthouseServiceServicer_to_server,
            _LighthouseServicer(self._coord),
            self._secret,
            "lighthouse",
            self._rpc_server,
        )
        bound = serve.bind(
            self._server, host, port, "choose another --bind port (0 picks a free one)", self._tls
        )
        await self._server.start()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())
        return bound

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.quorum_tick_ms / 1000)
            try:
                self._coord.tick()
            except Exception:
                logger.exception("lighthouse tick failed; continuing")

    def address(self) -> str:
        return f"{scheme(self._tls)}://{join_host_port(self._host, self._port)}"

    def http_address(self) -> str | None:
        return self._http.address() if self._http else None

    def status(self) -> dict[str, Any]:
        """The status page's data (thread-safe: read on the server's loop)."""
        snapshot: dict[str, Any] = self._loop.run(self._async(self._coord.snapshot), timeout=5)
        snapshot["kill"] = {"enabled": self._kill_button, "secret_set": self._secret is not None}
        return snapshot

    def kill(self, replica_id: str, typed_secret: str, peer: str) -> tuple[int, str]:
        """The status page's kill button (lighthouse.kill_button)."""
        described = self._coord.membership.described

        def lookup() -> QuorumMember | None:
            return self._loop.run(self._async(lambda: described.get(replica_id)), 5)  # type: ignore[no-any-return]

        return kill_button.kill(
            replica_id, typed_secret, peer, self._secret, self._kill_button, lookup, self._tls
        )

    @staticmethod
    async def _async(fn: Any) -> Any:
        return fn()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._http is not None:
            self._http.shutdown()
        if hasattr(self, "_server"):
            self._loop.run(self._stop(), timeout=10)
        self._loop.stop()

    async def _stop(self) -> None:
        if hasattr(self, "_ticker"):
            self._ticker.cancel()
        # Answer waiting Quorum calls before the server cancels their handlers
        # (a cancelled handler is logged by grpc as an unhandled error).
        waiting: list[asyncio.Future[Any]] = [
            f for f in self._coord.quorums.values() if not f.done()
        ]
        for future in waiting:
            future.set_exception(QuorumError("the lighthouse is shutting down"))
        spares = [f for f in self._coord.spares.values() if not f.done()]
        for spare in spares:
            spare.set_result("")  # "ask again": a spare outlives a lighthouse restart
        waiting += spares
        if waiting:
            await asyncio.sleep(0.05)  # lets their handlers send the answer
        await self._server.stop(grace=None)
        if self._state is not None:
            self._state.flush(time.monotonic(), force=True)


async def _write_all(
    context: aio.ServicerContext[Any, Any], outbox: asyncio.Queue[pb.LighthouseHeartbeatAdvice]
) -> None:
    """Writes a HeartbeatPaced stream's messages in order until cancelled
    or the stream fails (its reader then ends the call)."""
    try:
        while True:
            await context.write(await outbox.get())
    except asyncio.CancelledError:
        pass
    except Exception as e:  # the call ended under us (grpc's UsageError, an RpcError)
        logger.debug("heartbeat stream write failed: %s", e)


def _describe(tls: TLSConfig | None) -> str:
    if tls is None:
        return "plaintext (no TLS)"
    return "TLS, client certificates " + ("required" if tls.client_auth else "not required")
