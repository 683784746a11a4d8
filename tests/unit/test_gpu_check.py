"""scripts/gpu_check.py's pure parts: the plan for 0, 1, 2 and 8 GPUs (with
and without NCCL), the reading of pytest's JUnit XML, the budget, and that
every check names a real `cuda` test whose GPU need matches the plan. The
script itself runs in tests/integration/test_gpu_check_script.py."""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up
_spec.loader.exec_module(gc)

ONE_GPU_CHECKS = {
    "kill_heal_gloo_cuda", "http_heal_cuda", "nccl_reconfigure_flat",
    "baby_nccl_reconfigure_flat", "collective_timeout", "demo_cuda", "step_overhead_cuda",
    "cuda_paths",
}  # fmt: skip
TWO_GPU_CHECKS = {
    "nccl_across_groups", "kill_in_allreduce_nccl", "heal_over_nccl", "step_overhead_nccl"
}  # fmt: skip
NEEDS_NCCL = {"nccl_reconfigure_flat", "baby_nccl_reconfigure_flat", "cuda_paths"} | TWO_GPU_CHECKS


def test_the_checks_are_the_issues_list() -> None:
    names = [c.name for c in gc.CHECKS]
    assert len(names) == len(set(names))
    assert set(names) == ONE_GPU_CHECKS | TWO_GPU_CHECKS


def planned(cuda: bool, gpus: int, nccl: bool) -> dict[str, Any]:
    return {p.check.name: p for p in gc.plan(gc.Probe(cuda, gpus, nccl))}


def test_without_cuda_every_check_is_skipped_with_the_reason() -> None:
    for p in planned(False, 0, False).values():
        assert (p.variant, p.reason) == (None, gc.NO_CUDA)


def test_a_probe_error_is_the_reason() -> None:
    probe = gc.Probe(False, 0, False, error="torch cannot be imported (x)")
    assert {p.reason for p in gc.plan(probe)} == {"torch cannot be imported (x)"}


@pytest.mark.parametrize(
    "gpus, nccl, runs, timeout_variant, note",
    [
        (1, True, ONE_GPU_CHECKS, "gloo", "needs 2 GPUs, this machine has 1"),
        (2, True, ONE_GPU_CHECKS | TWO_GPU_CHECKS, "nccl", None),
        (8, True, ONE_GPU_CHECKS | TWO_GPU_CHECKS, "nccl", None),
        (1, False, ONE_GPU_CHECKS - NEEDS_NCCL, "gloo", "needs 2 GPUs"),
        (2, False, ONE_GPU_CHECKS - NEEDS_NCCL, "gloo", "has no NCCL"),
    ],
)
def test_the_plan_for_a_gpu_machine(gpus, nccl, runs, timeout_variant, note) -> None:
    plan = planned(True, gpus, nccl)
    assert {name for name, p in plan.items() if p.variant is not None} == runs
    for name, p in plan.items():
        if p.variant is None:
            assert p.reason, name
            if name in TWO_GPU_CHECKS and gpus < 2:
                assert f"needs 2 GPUs, this machine has {gpus}" in p.reason
                assert "NCCL refuses two ranks of one communicator on one GPU" in p.reason
            elif not nccl:
                assert p.reason == gc.NO_NCCL
        else:
            assert p.reason is None and p.variant.gpus <= gpus
    timeout = plan["collective_timeout"]
    assert timeout.variant.label == timeout_variant
    if note is None:
        assert timeout.note is None
    else:
        assert timeout.note.startswith("ran gloo, not nccl: ") and note in timeout.note


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="t" name="x">{body}</testcase></testsuite></testsuites>"""


@pytest.mark.parametrize(
    "body, want",
    [
        ('<properties><property name="mbps" value="12.5" /><property name="v" value="[1, 2]" />'
         '<property name="s" value="not json" /></properties>',
         {"status": "pass", "figures": {"mbps": 12.5, "v": [1, 2], "s": "not json"}}),
        ('<skipped type="pytest.skip" message="needs 2 GPUs">t.py:3: needs 2 GPUs</skipped>',
         {"status": "skipped", "reason": "needs 2 GPUs", "figures": {}}),
        ('<failure message="AssertionError: stalled 3.0 s">...</failure>',
         {"status": "fail", "reason": "AssertionError: stalled 3.0 s", "figures": {}}),
        ('<error message="failed on setup">...</error>',
         {"status": "fail", "reason": "failed on setup", "figures": {}}),
    ],
)  # fmt: skip
def test_the_outcome_and_figures_come_from_the_junit_xml(tmp_path, body, want) -> None:
    path = tmp_path / "x.xml"
    path.write_text(JUNIT.format(body=body))
    assert gc.outcome_from_junit(path) == want


def test_no_junit_or_no_test_case_is_no_outcome(tmp_path) -> None:
    assert gc.outcome_from_junit(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text("<testsuites><testsu")
    assert gc.outcome_from_junit(tmp_path / "cut.xml") is None
    (tmp_path / "empty.xml").write_text("<testsuites><testsuite/></testsuites>")
    assert gc.outcome_from_junit(tmp_path / "empty.xml") is None


def test_without_cuda_run_starts_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gc, "run_one", lambda *a: pytest.fail("a check was started"))
    entries = gc.run(gc.plan(gc.Probe(False, 0, False)), 450, tmp_path, "python", say=print)
    assert [e["name"] for e in entries] == [c.name for c in gc.CHECKS]
    for e in entries:
        assert e["status"] == "skipped" and e["reason"] == gc.NO_CUDA
        assert e["ran"] is None and e["figures"] == {} and e["test"].startswith("tests/gpu/")


def test_each_check_gets_its_timeout_or_what_is_left_and_none_past_the_budget(
    tmp_path, monkeypatch
) -> None:
    deadlines: list[float] = []

    def fake(p: Any, deadline_s: float, logs: Path, python: str) -> dict[str, Any]:
        deadlines.append(deadline_s)
        return {"status": "pass", "ran": "x", "figures": {"f": 1}}

    monkeypatch.setattr(gc, "run_one", fake)
    plan = gc.plan(gc.Probe(True, 1, True))
    entries = gc.run(plan, 1000, tmp_path, "python", say=lambda *a, **k: None)
    running = [p for p in plan if p.variant is not None]
    assert len(deadlines) == len(running)
    assert all(0 < d <= p.check.timeout_s for d, p in zip(deadlines, running))
    assert {e["status"] for e in entries} == {"pass", "skipped"}
    timeout = next(e for e in entries if e["name"] == "collective_timeout")
    assert timeout["variant"] == "gloo" and "needs 2 GPUs" in timeout["note"]

    deadlines.clear()
    entries = gc.run(plan, gc.MIN_START_S - 1, tmp_path, "python", say=lambda *a, **k: None)
    assert deadlines == []
    for e in entries:
        if e["name"] in ONE_GPU_CHECKS:
            assert e["status"] == "fail" and e["reason"].startswith("not run: ")


def test_an_unknown_check_name_is_refused_naming_the_checks(capsys) -> None:
    with pytest.raises(SystemExit):
        gc.main(["--only", "nope"])
    assert "unknown checks ['nope']" in capsys.readouterr().err


@cache
def module_ast(path: str) -> ast.Module:
    return ast.parse((REPO / path).read_text())


def test_every_check_names_a_cuda_test_whose_gpu_need_matches_the_plan() -> None:
    """Read from the source: the test exists, its module is marked `cuda`,
    its parameter is one of its parametrize values, and a variant that
    needs N >= 2 GPUs calls need_gpus(N) (the skip a hand run gets)."""
    for check in gc.CHECKS:
        for variant in check.variants:
            if "*" in variant.node:  # a glob of whole files: each one marked cuda
                paths = sorted(REPO.glob(variant.node))
                assert paths, variant.node
                for p in paths:
                    assert "pytest.mark.cuda" in p.read_text(), f"{p} is not marked cuda"
                continue
            path, _, rest = variant.node.partition("::")
            name, _, param = rest.partition("[")
            tree = module_ast(path)
            marks = [
                ast.unparse(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "pytestmark"
            ]
            assert "pytest.mark.cuda" in " ".join(marks), f"{path} is not marked cuda"
            fn = next(
                (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None
            )
            assert fn is not None, f"{variant.node}: no test {name} in {path}"
            source = ast.unparse(fn)
            if param:
                assert repr(param.rstrip("]")) in source, f"{variant.node}: no such parameter"
            if variant.gpus >= 2:
                assert f"need_gpus({variant.gpus})" in source, variant.node
