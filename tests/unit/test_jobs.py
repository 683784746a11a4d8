"""The rules of many jobs on one lighthouse (lighthouse.core.jobs), table-driven."""

from __future__ import annotations

import pytest

from lighthouse.core.jobs import (
    DEFAULT_JOB,
    JobActivity,
    JobPolicy,
    idle_jobs,
    job_id_refusal,
    job_refusal,
    member_refusal,
    parse_rule,
    total_refusal,
)
from lighthouse.core.quorum import LighthouseConfig

RULE = LighthouseConfig(min_replicas=1, join_timeout_ms=500)


@pytest.mark.parametrize(
    "job, why",
    [
        ("default", None),
        ("a", None),
        ("train-7_b", None),
        ("A" * 64, None),
        ("", "is empty"),
        ("A" * 65, "65 characters long"),
        ("-a", "holds a character"),
        ("_a", "holds a character"),
        ("a.b", "holds a character"),
        ("a/b", "holds a character"),
        ("../x", "holds a character"),
        ("a b", "holds a character"),
        ("é", "holds a character"),
        ("a\n", "holds a character"),
    ],
)
def test_a_job_id_is_letters_digits_dash_and_underscore(job, why):
    got = job_id_refusal(job)
    if why is None:
        assert got is None
    else:
        assert why in got and "TORCHFT_JOB_ID" in got


def test_a_long_bad_job_id_is_not_echoed_whole():
    assert len(job_id_refusal("!" * 100_000)) < 400


@pytest.mark.parametrize(
    "job, rule, secret",
    [
        ("default", (1, 500), "global"),
        ("a", (3, 500), "sa"),
        ("b", (1, 20), "sb"),
        ("c", (1, 500), "global"),
    ],
)
def test_each_job_has_its_rule_and_its_secret(job, rule, secret):
    policy = JobPolicy(
        RULE,
        rules={"a": {"min_replicas": 3}, "b": {"join_timeout_ms": 20}},
        secret="global",
        secrets={"a": "sa", "b": "sb"},
    )
    got = policy.rule_of(job)
    assert (got.min_replicas, got.join_timeout_ms) == rule
    assert got.heartbeat_timeout_ms == RULE.heartbeat_timeout_ms
    assert policy.secret_of(job) == secret
    assert policy.protected(job) == (job in ("a", "b"))


def test_without_a_lighthouse_secret_a_job_without_its_own_is_open():
    policy = JobPolicy(RULE, secrets={"a": "sa"})
    assert policy.secret_of("c") is None and policy.secret_of("a") == "sa"


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"max_jobs": 0}, "--max-jobs"),
        ({"max_members": 0}, "--max-members-per-job"),
        ({"max_total": 0}, "--max-members)"),
        ({"idle_s": 0}, "--job-idle-s"),
        ({"rules": {"a": {"heartbeat_timeout_ms": 5}}}, "cannot be set per job"),
        ({"rules": {"a": {"min_replicas": 0}}}, "min_replicas (0) must be at least 1"),
        ({"rules": {"bad id": {"min_replicas": 2}}}, "holds a character"),
        ({"secrets": {"": "s"}}, "is empty"),
    ],
)
def test_a_bad_policy_is_refused_with_what_to_set(kwargs, text):
    with pytest.raises(ValueError) as e:
        JobPolicy(RULE, **kwargs)
    assert text in str(e.value)


@pytest.mark.parametrize(
    "known, exists, max_jobs, refused",
    [
        (0, False, 1, False),
        (999, False, 1000, False),
        (1000, False, 1000, True),
        (1000, True, 1000, False),  # a job it holds is never refused
        (1, False, 1, True),
    ],
)
def test_a_new_job_past_max_jobs_is_refused(known, exists, max_jobs, refused):
    why = job_refusal("j", known, exists, max_jobs)
    assert (why is not None) == refused
    if refused:
        assert f"--max-jobs {max_jobs}" in why and "--job-idle-s" in why


def test_a_member_past_a_bound_is_told_which_flag():
    why = member_refusal("j", "r" * 1000, 5, 5)
    assert "--max-members-per-job 5" in why and len(why) < 500
    why = total_refusal("r" * 1000, 7, 7)
    assert "--max-members 7" in why and len(why) < 500


@pytest.mark.parametrize(
    "jobs, now, expected",
    [
        ({"a": JobActivity(False, 0.0)}, 10.0, ["a"]),
        ({"a": JobActivity(False, 0.0)}, 9.9, []),
        ({"a": JobActivity(True, None)}, 100.0, []),
        ({"a": JobActivity(False, None)}, 100.0, []),  # not seen empty yet
        ({DEFAULT_JOB: JobActivity(False, 0.0)}, 1e9, []),  # never the default job
        (
            {"a": JobActivity(False, 0.0), "b": JobActivity(False, 5.0), "c": JobActivity(True, 0)},
            12.0,
            ["a"],
        ),
    ],
)
def test_a_job_empty_for_idle_s_is_forgotten(jobs, now, expected):
    assert idle_jobs(jobs, now, 10.0) == expected


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("a.min_replicas=2", ("a", "min_replicas", 2)),
        ("train-7.join_timeout_ms=500", ("train-7", "join_timeout_ms", 500)),
    ],
)
def test_a_job_rule_reads(text, parsed):
    assert parse_rule(text) == parsed


@pytest.mark.parametrize(
    "text, why",
    [
        ("a=2", "is not JOB.OPTION=VALUE"),
        ("a.min_replicas", "is not JOB.OPTION=VALUE"),
        ("a.quorum_tick_ms=5", "a job may set min_replicas, join_timeout_ms"),
        ("a.min_replicas=two", "is not an integer"),
        ("a b.min_replicas=2", "holds a character"),
    ],
)
def test_a_bad_job_rule_says_why(text, why):
    with pytest.raises(ValueError) as e:
        parse_rule(text)
    assert why in str(e.value)
