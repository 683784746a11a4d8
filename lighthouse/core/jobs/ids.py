"""Job ids: what one is, the default one, and how a job's rule is written.

A call names its job in the `torchft-job` metadata; a call without it (every
pytorch/torchft client) is in the `default` job.
"""

from __future__ import annotations

import re

DEFAULT_JOB = "default"
"""The job of a call that names none (lighthouse.rpc.auth.JOB_METADATA_KEY)."""
JOB_ENV = "TORCHFT_JOB_ID"
MAX_JOB_ID_CHARS = 64
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
RULE_FIELDS = ("min_replicas", "join_timeout_ms")
"""The quorum rule's options a job may set for itself (`--job-rule`)."""


def job_id_refusal(job_id: str) -> str | None:
    """Why `job_id` is not a job id, with what to set; None if it is one.

    A job id is 1-64 ASCII letters, digits, '-' and '_', not starting with
    '-' or '_': it names a state file and a metric label as it is.
    """
    fix = (
        f"set {JOB_ENV} (or Manager(job_id=...)) to 1-{MAX_JOB_ID_CHARS} ASCII letters, "
        "digits, '-' or '_', starting with a letter or digit"
    )
    if not job_id:
        return f"the job id is empty; {fix}"
    if len(job_id) > MAX_JOB_ID_CHARS:
        return f"the job id is {len(job_id)} characters long; {fix}"
    if not _JOB_ID.fullmatch(job_id):
        return f"the job id {job_id[:MAX_JOB_ID_CHARS]!r} holds a character it may not; {fix}"
    return None


def check_job_id(job_id: str) -> str:
    """`job_id` if valid. Raises ValueError (job_id_refusal's text)."""
    why = job_id_refusal(job_id)
    if why is not None:
        raise ValueError(why)
    return job_id


def parse_rule(text: str) -> tuple[str, str, int]:
    """`JOB.OPTION=VALUE` (a `--job-rule`) as (job, option, value).

    Raises:
        ValueError: not of that form, a bad job id, an option a job cannot
            set, or a value that is not an integer.
    """
    head, sep, value = text.partition("=")
    job, dot, option = head.rpartition(".")
    if not sep or not dot:
        raise ValueError(
            f"--job-rule {text!r} is not JOB.OPTION=VALUE, e.g. train-7.min_replicas=2"
        )
    check_job_id(job)
    if option not in RULE_FIELDS:
        raise ValueError(
            f"--job-rule {text!r}: a job may set {', '.join(RULE_FIELDS)}, not {option!r}"
        )
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--job-rule {text!r}: {value!r} is not an integer") from None
    return job, option, number
