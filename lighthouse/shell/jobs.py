"""The jobs of one lighthouse: a Coordinator each, made on a job's first
call, ticked in turn, forgotten when idle (lighthouse.core.jobs has the
rules). All on the server's loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from lighthouse.core.jobs import (
    DEFAULT_JOB,
    JobActivity,
    JobPolicy,
    idle_jobs,
    job_id_refusal,
    job_refusal,
)
from lighthouse.rpc.auth import JOB_METADATA_KEY
from lighthouse.rpc.call import Call
from lighthouse.rpc.errors import JobLimitError
from lighthouse.rpc.h2.limits import TokenBucket
from lighthouse.shell.coordinator import Coordinator, ReplicaCount
from lighthouse.shell.metrics import LighthouseMetrics
from lighthouse.shell.state_file import StateFiles

logger = logging.getLogger("lighthouse.shell.server")

SWEEP_S = 1.0
"""How often idle jobs are looked for."""
NOTES_RATE = (50.0, 1.0)
"""Job opening and end lines logged at INFO: 50, then one a second."""
TRIM_AFTER_JOBS = 64
TRIM_EVERY_S = 5.0
"""Forgotten jobs' memory is collected and the heap trimmed (trim_heap) at
most every 5 s, once 64 jobs were forgotten since the last time or the
forgetting paused: a job's
objects hold each other, and the standalone process runs a full collection
seldom (lighthouse.cli.tune_gc)."""


def trim_heap() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim;
    elsewhere nothing): glibc keeps the pages of what it frees."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return
    started = time.perf_counter()
    trim(0)
    logger.info(
        "heap trimmed after forgotten jobs, in %.1f ms", 1000 * (time.perf_counter() - started)
    )


def job_of(call: Call) -> str:
    """The job a call names (its `torchft-job` metadata), else the default job."""
    for key, value in call.invocation_metadata() or ():
        if key == JOB_METADATA_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return DEFAULT_JOB


class Jobs:
    """Every job's Coordinator, by job id. The default job always exists;
    so does each job a state file brings back (lighthouse.shell.state_file)."""

    def __init__(
        self,
        policy: JobPolicy,
        metrics: LighthouseMetrics,
        states: StateFiles | None,
        collect_after_issue: bool = False,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.states = states
        self.collect_after_issue = collect_after_issue
        self.by_id: dict[str, Coordinator] = {}
        self.replicas = ReplicaCount(policy.max_total)
        self._empty_since: dict[str, float] = {}
        self._swept_at = time.monotonic()
        self._notes = TokenBucket(NOTES_RATE)
        self._unsaid = 0
        """Opening and end lines not said at INFO since the last summary."""
        self._unsaid_told_at = float("-inf")
        self._forgotten = 0
        """Jobs forgotten since the heap was last trimmed (trim_heap)."""
        self._trimmed_at = float("-inf")
        self._turn: list[Coordinator] = []
        """Busy jobs still to tick in this round (`tick`)."""
        saved = states.saved_jobs() if states is not None else []
        for job in [DEFAULT_JOB, *[j for j in saved if j != DEFAULT_JOB]]:
            if len(self.by_id) >= policy.max_jobs and job != DEFAULT_JOB:
                logger.warning(
                    "state file of job %s not restored: more saved jobs than --max-jobs %d",
                    job,
                    policy.max_jobs,
                )
                continue
            self._make(job)

    @property
    def default(self) -> Coordinator:
        return self.by_id[DEFAULT_JOB]

    def of(self, call: Call) -> Coordinator:
        """The Coordinator of the job `call` names, made if new.

        Raises:
            ValueError: the job id is not one (lighthouse.core.jobs.job_id_refusal).
            JobLimitError: a new job past --max-jobs.
        """
        return self.get(job_of(call))

    def get(self, job: str) -> Coordinator:
        """`job`'s Coordinator, made if new (raises as `of`)."""
        coord = self.by_id.get(job)
        if coord is not None:
            return coord
        why = job_id_refusal(job)
        if why is not None:
            raise ValueError(why)
        why = job_refusal(job, len(self.by_id), False, self.policy.max_jobs)
        if why is not None:
            raise JobLimitError(why)
        return self._make(job)

    def _make(self, job: str) -> Coordinator:
        state = self.states.for_job(job) if self.states is not None else None
        coord = Coordinator(
            self.policy.rule_of(job),
            self.metrics.for_job(job),
            state,
            self.collect_after_issue,
            job,
            self.policy.max_members,
            self.replicas,
        )
        self.by_id[job] = coord
        self._empty_since[job] = time.monotonic()
        self.metrics.jobs.set(len(self.by_id))
        if job != DEFAULT_JOB:
            restored = state.restored if state is not None else None
            self._note(
                coord,
                "job opened%s",
                ""
                if restored is None
                else f" from its state file (high-water mark step {restored.high_water_step})",
            )
        return coord

    def _note(self, coord: Coordinator, msg: str, *args: Any) -> None:
        """A job's opening or end, at INFO within NOTES_RATE, else counted:
        a peer that opens job after job cannot fill the log."""
        if self._notes.take():
            coord.log.info(msg, *args)
        else:
            self._unsaid += 1
            coord.log.debug(msg, *args)

    def __iter__(self) -> Iterator[Coordinator]:
        return iter(list(self.by_id.values()))

    def tick(self) -> None:
        """The periodic event of every busy job, one job per loop turn, so
        that a job of thousands (its decision is O(replicas)) delays another
        job's calls by one job's work, not by every job's."""
        if self._turn:  # the last round is not over: the loop is busy enough
            return
        self._turn = [c for c in self.by_id.values() if c.busy()]
        self._turn.reverse()
        self._tick_next()
        now = time.monotonic()
        if now - self._swept_at >= SWEEP_S:
            self._swept_at = now
            self.sweep(now)

    def _tick_next(self) -> None:
        while self._turn:
            coord = self._turn.pop()
            if self.by_id.get(coord.job) is not coord:
                continue  # forgotten since
            try:
                coord.tick()
            except Exception:
                logger.exception("lighthouse tick of job %s failed; continuing", coord.job)
            if self._turn:
                asyncio.get_running_loop().call_soon(self._tick_next)
            return

    def sweep(self, now: float) -> list[str]:
        """Forgets the jobs empty for --job-idle-s; returns them."""
        self.replicas.total = sum(len(c.membership.heartbeats) for c in self.by_id.values())
        activity = {}
        for job, coord in self.by_id.items():
            busy = coord.busy()
            if busy:
                self._empty_since.pop(job, None)
            else:
                self._empty_since.setdefault(job, now)
            activity[job] = JobActivity(busy, self._empty_since.get(job))
        gone = idle_jobs(activity, now, self.policy.idle_s)
        for job in gone:
            self.forget(job)
        if self._unsaid and now - self._unsaid_told_at >= 60:
            logger.info("%d more jobs opened or forgotten (lines at DEBUG)", self._unsaid)
            self._unsaid, self._unsaid_told_at = 0, now
        self._forgotten += len(gone)
        quiet = not gone  # the churn paused: what it left goes now
        if (
            self._forgotten
            and (self._forgotten >= TRIM_AFTER_JOBS or quiet)
            and now - self._trimmed_at >= TRIM_EVERY_S
        ):
            self._forgotten, self._trimmed_at = 0, now
            gc.collect()  # a job is cycles: the standalone process seldom collects them
            trim_heap()
        return gone

    def forget(self, job: str) -> None:
        coord = self.by_id.pop(job)
        self._empty_since.pop(job, None)
        coord.close()
        self.metrics.forget(job)
        self.metrics.jobs.set(len(self.by_id))
        if self.states is not None:
            self.states.forget(job)
        self._note(coord, "job forgotten: no member for %.0f s (--job-idle-s)", self.policy.idle_s)

    def summaries(self) -> list[dict[str, Any]]:
        """One line per job for the status page's list."""
        now, wall = time.monotonic(), time.time()
        return [
            coord.summary(now, wall, self.policy.protected(job))
            for job, coord in sorted(self.by_id.items())
        ]
