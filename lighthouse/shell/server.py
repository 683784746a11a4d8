"""The lighthouse server: gRPC service, waiting callers and the tick loop.

All state lives on one asyncio loop (no locks). Each RPC is an event of the
membership state machine (lighthouse.core.membership), which decides; this module
reads the clock, keeps each waiting call's future under its ticket, and acts
on the effects: answers calls, logs, updates metrics and feeds the status
page's memory (lighthouse.status.view).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from lighthouse import wire
from lighthouse.core.jobs import DEFAULT_JOB, JobPolicy
from lighthouse.core.quorum import LighthouseConfig, QuorumMember
from lighthouse.loop import BackgroundLoop, reply_budget_s
from lighthouse.rpc import auth, errors, serve
from lighthouse.rpc.address import advertised_host, join_host_port, parse_bind
from lighthouse.rpc.call import Call
from lighthouse.rpc.errors import DuplicateGroupError, JobLimitError, QuorumError
from lighthouse.rpc.h2.limits import LIMITS
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig, scheme
from lighthouse.shell.coordinator import Coordinator, Outbox
from lighthouse.shell.jobs import Jobs
from lighthouse.shell.metrics import LighthouseMetrics
from lighthouse.shell.state_file import StateFiles, log_start
from lighthouse.status import kill_button
from lighthouse.status.server import StatusServer

logger = logging.getLogger(__name__)


class _LighthouseServicer:
    """LighthouseService, registered by its method names, on either runtime
    (one call shape: lighthouse.rpc.call). Thin: converts, calls the
    coordinator of the call's job (lighthouse.shell.jobs), converts back,
    maps errors (lighthouse.rpc.errors)."""

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs

    async def Quorum(self, request: pb.LighthouseQuorumRequest, call: Call) -> None:
        """Parks the call: the coordinator answers it in the turn that issues
        its quorum, or fails it, at the latest at its reply budget."""
        budget_s = reply_budget_s(call.time_remaining())
        try:
            coord = self._jobs.of(call)
            member = wire.quorum_request_from_proto(request)
            viewer = wire.viewer_from_proto(request, member)
            coord.park(member, call, viewer, budget_s)
        except Exception as e:
            await errors.abort(call, e)

    async def Heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, call: Call
    ) -> pb.LighthouseHeartbeatResponse:
        if not request.replica_id:
            await errors.abort(call, ValueError("replica_id must be a non-empty string"))
        try:
            self._jobs.of(call).heartbeat(request.replica_id)
        except (ValueError, DuplicateGroupError, JobLimitError) as e:
            await errors.abort(call, e)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatStream(self, requests: Any, call: Call) -> pb.LighthouseHeartbeatResponse:
        await self._heartbeats(call, None)
        return pb.LighthouseHeartbeatResponse()

    async def HeartbeatPaced(self, requests: Any, call: Call) -> None:
        """HeartbeatStream that answers with the period to heartbeat at
        (lighthouse.core.pacing): on the first heartbeat and after each change."""
        await self._heartbeats(call, call)

    async def _heartbeats(self, call: Call, outbox: Outbox | None) -> None:
        """Takes each heartbeat as it comes (no task wakes per heartbeat on
        our own runtime). `outbox` gets the advice from here, and gone
        notices from the coordinator (lighthouse.core.gone) as soon as they
        are decided."""
        try:
            coord = self._jobs.of(call)
        except (ValueError, JobLimitError) as e:
            await errors.abort(call, e)
        stream = _HeartbeatStream(coord, outbox)
        try:
            await call.deliver(stream.take)
        except (ValueError, DuplicateGroupError, JobLimitError) as e:
            await errors.abort(call, e)
        finally:
            # Also on cancellation: the client's connection closed under us.
            if stream.replica_id:
                coord.stream_ended(stream.replica_id, outbox)

    async def TakeReplicaGroup(self, request: pb.TakeReplicaGroupRequest, call: Call) -> None:
        """Parks the call: the coordinator answers it with the group to train
        as, or with "" when the call's deadline comes first (the caller asks
        again: a spare may wait for hours)."""
        budget_s = reply_budget_s(call.time_remaining())
        try:
            self._jobs.of(call).park_spare(request.spare_id, request.wanted, call, budget_s)
        except Exception as e:
            await errors.abort(call, e)

    async def Leave(
        self, request: pb.LighthouseLeaveRequest, call: Call
    ) -> pb.LighthouseLeaveResponse:
        if not request.replica_id:
            await errors.abort(call, ValueError("replica_id must be a non-empty string"))
        try:
            coord = self._jobs.of(call)
        except (ValueError, JobLimitError) as e:
            await errors.abort(call, e)
        coord.leave(request.replica_id)
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
        rule: the quorum rule's other options, by name: the fields of
            lighthouse.LighthouseConfig (join_timeout_ms, quorum_tick_ms,
            heartbeat_timeout_ms, suspect_phi, suspect_min_ms, allow_fresh_start).
        http_bind: `host:port` of the status page and /metrics; None: no page.
        secret: the shared secret of every job without one of its own, or None.
        tls: serve TLS with this configuration, or None for plaintext.
        kill_button: offer a kill form per replica on the status page.
        state_file: keep the job's high-water mark and last quorum in this
            file across restarts (lighthouse.shell.state_file); None: in memory only.
        rpc_server: what serves the gRPC port (lighthouse.rpc.serve.RPC_SERVERS).
        collect_after_issue: run the collector's young generations once a
            quorum's answers are out (the standalone process: lighthouse.cli.tune_gc).
        job_secrets: job id -> the secret of that job alone (lighthouse.core.jobs):
            its calls must carry it, and it is refused in every other job.
        job_rules: job id -> {min_replicas, join_timeout_ms} of that job.
        max_jobs: the most jobs held at once (a new one past it is refused).
        max_members_per_job: the most replicas one job may have.
        max_members: the most replicas all jobs together may have.
        job_idle_s: a job with no member for this long is forgotten.

    Raises:
        ValueError: a bad option or an unparsable bind address.
        TypeError: an option no lighthouse has.
        OSError: the port is already in use.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        *,
        http_bind: str | None = None,
        secret: str | None = None,
        tls: TLSConfig | None = None,
        kill_button: bool = False,
        state_file: str | None = None,
        rpc_server: str = "lean",
        collect_after_issue: bool = False,
        job_secrets: dict[str, str] | None = None,
        job_rules: dict[str, dict[str, int]] | None = None,
        max_jobs: int = 1000,
        max_members_per_job: int = 20_000,
        max_members: int = 100_000,
        job_idle_s: float = 3600.0,
        **rule: Any,
    ) -> None:
        if tls is not None:
            tls.require_server("lighthouse")
        self.config = _rule(min_replicas, rule)
        self.policy = JobPolicy(
            self.config,
            job_rules or {},
            secret,
            job_secrets or {},
            max_jobs,
            max_members_per_job,
            max_members,
            job_idle_s,
        )
        host, port = parse_bind(bind)
        self.metrics = LighthouseMetrics()
        states = StateFiles(state_file) if state_file else None
        self.jobs = Jobs(self.policy, self.metrics, states, collect_after_issue)
        self._loop = BackgroundLoop("lighthouse_loop")
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
                self._http = StatusServer(
                    http_bind, self.status, self.metrics.render, self.kill, self.protected
                )
        except BaseException:
            self.shutdown()
            raise
        logger.info("lighthouse listening on %s (gRPC, bind %s)", self.address(), bind)
        logger.info("access control: %s", _access(secret, self.policy))
        logger.info("transport: %s", _describe(tls))
        log_start(self.jobs.default.state, self.config.allow_fresh_start)
        if len(self.jobs.by_id) > 1:
            logger.info("state files: %d other jobs restored", len(self.jobs.by_id) - 1)
        warning = auth.exposure_warning(secret, host, "lighthouse")
        if warning:
            logger.warning("%s", warning)

    async def _start(self, host: str, port: int) -> int:
        self._server = serve.new_server(
            pb_grpc.add_LighthouseServiceServicer_to_server,
            _LighthouseServicer(self.jobs),
            auth.Secrets(self._secret, self.policy.secrets),
            "lighthouse",
            self._rpc_server,
            LIMITS.stream_message_rate,  # a heartbeat an advised interval
        )
        self.metrics.watch_calmed(self._server.calmed)
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
                self.jobs.tick()
            except Exception:
                logger.exception("lighthouse tick failed; continuing")

    def address(self) -> str:
        return f"{scheme(self._tls)}://{join_host_port(self._host, self._port)}"

    def http_address(self) -> str | None:
        return self._http.address() if self._http else None

    def status(self, job: str = DEFAULT_JOB) -> dict[str, Any]:
        """The status page's data of `job`, and every job's line (thread-safe:
        read on the server's loop).

        Raises:
            KeyError: the lighthouse holds no such job.
        """

        def read() -> dict[str, Any]:
            coord = self.jobs.by_id.get(job)
            if coord is None:
                raise KeyError(job)
            return {**coord.snapshot(), "jobs": self.jobs.summaries()}

        snapshot: dict[str, Any] = self._loop.run(self._async(read), timeout=5)
        snapshot["kill"] = {
            "enabled": self._kill_button,
            "secret_set": self.policy.secret_of(job) is not None,
        }
        return snapshot

    def protected(self, job: str) -> str | None:
        """The secret only whose holders may see `job`'s page, or None (open)."""
        return self.policy.secrets.get(job)

    def kill(
        self, replica_id: str, typed_secret: str, peer: str, job: str = DEFAULT_JOB
    ) -> tuple[int, str]:
        """The status page's kill button of `job` (lighthouse.status.kill_button):
        the secret typed must be that job's."""

        def lookup() -> QuorumMember | None:
            def find() -> QuorumMember | None:
                coord = self.jobs.by_id.get(job)
                return coord.membership.described.get(replica_id) if coord else None

            return self._loop.run(self._async(find), 5)  # type: ignore[no-any-return]

        return kill_button.kill(
            replica_id,
            typed_secret,
            peer,
            self.policy.secret_of(job),
            self._kill_button,
            lookup,
            self._tls,
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
        # Answer waiting calls before the server cancels their handlers (a
        # cancelled handler is logged by grpc as an unhandled error); a spare
        # hears "ask again": it outlives a lighthouse restart.
        waiting = False
        for coord in self.jobs:
            waiting = waiting or bool(coord.parked)
            for ticket in list(coord.parked):
                coord.end(ticket, QuorumError("the lighthouse is shutting down"))
            coord.deadlines.close()
        if waiting:
            await asyncio.sleep(0.05)  # lets their handlers send the answer
        await self._server.stop(grace=None)
        for coord in self.jobs:
            if coord.state is not None:
                coord.state.flush(time.monotonic(), force=True)


class _HeartbeatStream:
    """One heartbeat stream's state: the replica it carries, and the advice
    it was last given (None: a stream that is not advised)."""

    def __init__(self, coord: Coordinator, outbox: Outbox | None) -> None:
        self.coord = coord
        self.replica_id = ""
        self.advised = 0
        self.outbox = outbox

    def take(self, request: pb.LighthouseHeartbeatRequest) -> None:
        """One heartbeat. Raises ValueError (not one replica_id) or DuplicateGroupError."""
        if not request.replica_id:  # (also the first: "" is no replica's id)
            raise ValueError("replica_id must be a non-empty string")
        if request.replica_id != self.replica_id:
            if self.replica_id:
                raise ValueError(
                    f"one heartbeat stream carries one replica_id: got "
                    f"{request.replica_id!r} after {self.replica_id!r}; open a stream each"
                )
            self.replica_id = request.replica_id
            self.coord.stream_opened(self.replica_id, self.outbox)
        self.coord.heartbeat(self.replica_id)
        advice = self.coord.membership.advice_ms
        if self.outbox is not None and self.advised != advice:
            self.advised = advice
            self.outbox.write(pb.LighthouseHeartbeatAdvice(interval_ms=advice))


def _rule(min_replicas: int, options: dict[str, Any]) -> LighthouseConfig:
    """The quorum rule's config; an option it lacks is named, with those it has."""
    known = {f.name for f in dataclasses.fields(LighthouseConfig)} - {"min_replicas"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"LighthouseServer got unknown option(s) {', '.join(unknown)}; the quorum rule's "
            f"are {', '.join(sorted(known))} (lighthouse.LighthouseConfig), the server's "
            "bind, min_replicas, http_bind, secret, tls, kill_button, state_file, rpc_server, "
            "collect_after_issue, job_secrets, job_rules, max_jobs, max_members_per_job, "
            "max_members, job_idle_s"
        )
    return LighthouseConfig(min_replicas=min_replicas, **options)


def _access(secret: str | None, policy: JobPolicy) -> str:
    own = f"; {len(policy.secrets)} jobs with a secret of their own" if policy.secrets else ""
    return ("on (shared secret)" if secret else "off (no secret)") + own


def _describe(tls: TLSConfig | None) -> str:
    if tls is None:
        return "plaintext (no TLS)"
    return "TLS, client certificates " + ("required" if tls.client_auth else "not required")
