"""When a job may open, a replica join it, and a job be forgotten."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lighthouse.core.jobs.ids import DEFAULT_JOB


def job_refusal(job: str, known: int, exists: bool, max_jobs: int) -> str | None:
    """Why a call may not open `job`, which the lighthouse does not hold
    yet (`exists` False) while it holds `known` jobs; None: it may."""
    if exists or known < max_jobs:
        return None
    return (
        f"the lighthouse holds {known} jobs, its most (--max-jobs {max_jobs}); job {job!r} "
        "cannot start until one ends (a job with no member is forgotten after --job-idle-s), "
        "or restart the lighthouse with a larger --max-jobs"
    )


def member_refusal(job: str, replica_id: str, known: int, max_members: int) -> str:
    """What a new replica is told when its job already knows `max_members`."""
    return (
        f"job {job!r} already has {known} replicas, the most one job may have "
        f"(--max-members-per-job {max_members}); replica {replica_id[:200]!r} is refused until "
        "some leave or are forgotten"
    )


def total_refusal(replica_id: str, total: int, max_total: int) -> str:
    """What a new replica is told when the lighthouse's jobs together know `max_total`."""
    return (
        f"the lighthouse's jobs already have {total} replicas, the most it holds "
        f"(--max-members {max_total}); replica {replica_id[:200]!r} is refused until some "
        "leave or are forgotten"
    )


@dataclass(frozen=True)
class JobActivity:
    """What decides whether a job may be forgotten: whether anyone is in
    it (members heard from, calls waiting, streams open) and since when
    it has been empty."""

    busy: bool
    empty_since: float | None


def idle_jobs(jobs: Mapping[str, JobActivity], now: float, idle_s: float) -> list[str]:
    """The jobs to forget now: empty for `idle_s` or more, never the default job."""
    return [
        job
        for job, activity in jobs.items()
        if job != DEFAULT_JOB
        and not activity.busy
        and activity.empty_since is not None
        and now - activity.empty_since >= idle_s
    ]
