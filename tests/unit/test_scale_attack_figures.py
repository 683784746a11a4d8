"""bench.lighthouse_scale --attack's figures, from made-up load results: no processes."""

from __future__ import annotations

import grpc

from bench._scale_attack import compare, judged_gone
from bench._scale_load import failure_kind
from lighthouse.rpc.lean.client_calls import CallFailed, Unavailable


def test_failures_are_told_apart_by_kind():
    assert failure_kind(CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")) == "refused"
    assert failure_kind(CallFailed(grpc.StatusCode.UNAVAILABLE, "later")) == "refused"
    assert failure_kind(Unavailable("the server reset the call (HTTP/2 error 7)")) == "refused"
    assert failure_kind(Unavailable("the server reset the call (HTTP/2 error 2)")) == "reset"
    assert failure_kind(Unavailable("connection lost: closed by the server")) == "reset"
    assert failure_kind(Unavailable("the server is going away")) == "reset"
    assert failure_kind(CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "late")) == "failed"
    assert failure_kind("no answer") == "failed"


def load(killed=None, gone=None, short=None):
    return {"killed": killed or {}, "gone_heard": gone or {}, "short": short or {}}


def test_judged_gone_leaves_out_the_killed_and_the_teardown():
    results = [
        load(killed={"group00000:0": 5.0}, gone={"group00000:0": 5.1, "group00003:0": 6.0}),
        load(gone={"group00007:0": 99.0}, short={"4": 2, "9": 1}),  # 99.0: after the window
    ]
    # Group 0 was killed before step 4: steps 4-7 may leave it out; step 9 may not.
    assert judged_gone(results, {"0": 4}, until=10.0) == {"gone_notices": 1, "short_answers": 1}
    assert judged_gone([load(short={"4": 3})], {}, until=10.0)["short_answers"] == 3


def run(p99, cpu_s, **more):
    return {"quorum_p50_ms": 1.0, "quorum_p99_ms": p99, "lighthouse_cpu_s": cpu_s, **more}


def test_compare_checks_the_criteria():
    without = run(100.0, 1.0, attack=None, attack_mb=0.0)
    row = compare(without, run(120.0, 3.0, attack="a", attack_mb=4.0, refused=0, reset=0))
    assert row["meets"] and row["p99_ratio"] == 1.2
    assert (row["cpu_s_per_mb"], row["extra_cpu_s_per_mb"]) == (0.75, 0.5)
    row = compare(without, run(130.0, 3.0, attack="a", attack_mb=4.0, reset=2, judged_gone=1))
    assert not row["meets"]
    assert row["misses"] == "p99 x1.3; 2 reset; 1 judged gone"
    failed = compare(without, {"attack": "a", "failed": "the attacker did not start"})
    assert not failed["meets"] and failed["cpu_s_per_mb"] is None
