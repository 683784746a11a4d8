"""Jobs on one lighthouse: each a lighthouse of its own inside the process
(lighthouse.shell.jobs): members, quorums, heartbeats, spares, the
fresh-start mark, its rule, its secret and its state file. Pure: no clock,
no socket. One line per room:

- `ids`: what a job id is, the default job, a `--job-rule`;
- `policy`: each job's rule and secret, and the bounds (JobPolicy);
- `limits`: when a job may open, a replica join it, a job be forgotten.
"""

from lighthouse.core.jobs.ids import (
    DEFAULT_JOB,
    JOB_ENV,
    MAX_JOB_ID_CHARS,
    RULE_FIELDS,
    check_job_id,
    job_id_refusal,
    parse_rule,
)
from lighthouse.core.jobs.limits import (
    JobActivity,
    idle_jobs,
    job_refusal,
    member_refusal,
    total_refusal,
)
from lighthouse.core.jobs.policy import JobPolicy

__all__ = [
    "DEFAULT_JOB",
    "JOB_ENV",
    "MAX_JOB_ID_CHARS",
    "RULE_FIELDS",
    "JobActivity",
    "JobPolicy",
    "check_job_id",
    "idle_jobs",
    "job_id_refusal",
    "job_refusal",
    "member_refusal",
    "parse_rule",
    "total_refusal",
]
