"""What the operator set for the jobs of one lighthouse: their rules, secrets and bounds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lighthouse.core.jobs.ids import RULE_FIELDS, check_job_id
from lighthouse.core.quorum import LighthouseConfig


@dataclass(frozen=True)
class JobPolicy:
    """What the operator set for the jobs of one lighthouse.

    `rule` is every job's quorum rule; `rules` override its RULE_FIELDS per
    job. `secret` guards every job without one of its own in `secrets`
    (None: open). A peer can make the lighthouse hold `max_jobs` jobs of
    `max_members` replicas each, `max_total` replicas in all; a job left with
    no member for `idle_s` is forgotten (the default job never is: it is a
    single-job lighthouse's).
    """

    rule: LighthouseConfig
    rules: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    secret: str | None = None
    secrets: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_jobs: int = 1000
    max_members: int = 20_000
    max_total: int = 100_000
    idle_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_jobs < 1:
            raise ValueError(f"max_jobs ({self.max_jobs}) must be at least 1 (--max-jobs)")
        if self.max_members < 1:
            raise ValueError(
                f"max_members ({self.max_members}) must be at least 1 (--max-members-per-job)"
            )
        if self.max_total < 1:
            raise ValueError(f"max_total ({self.max_total}) must be at least 1 (--max-members)")
        if not self.idle_s > 0:
            raise ValueError(f"idle_s ({self.idle_s}) must be positive (--job-idle-s)")
        for job in (*self.rules, *self.secrets):
            check_job_id(job)
        for job, options in self.rules.items():
            unknown = sorted(set(options) - set(RULE_FIELDS))
            if unknown:
                raise ValueError(
                    f"job {job!r}: {', '.join(unknown)} cannot be set per job; "
                    f"a job may set {', '.join(RULE_FIELDS)}"
                )
            self.rule_of(job)  # raises ValueError on a bad value

    def rule_of(self, job: str) -> LighthouseConfig:
        """The quorum rule of `job`: every job's, with its own overrides."""
        options: dict[str, Any] = dict(self.rules.get(job) or {})
        return dataclasses.replace(self.rule, **options) if options else self.rule

    def secret_of(self, job: str) -> str | None:
        """The secret a call to `job` must carry: its own, else the lighthouse's."""
        return self.secrets.get(job, self.secret)

    def protected(self, job: str) -> bool:
        """Whether `job` has a secret of its own: only its holders see it."""
        return job in self.secrets
