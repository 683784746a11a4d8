"""Replica groups on real GPUs, end to end, as scripts/gpu_check.sh runs them:
a lighthouse and groups as real processes (torchrun running
examples/train_ddp.py, or this module's `worker`), real SIGKILLs, healing
over HTTP and over NCCL, the demo and the step-cost benchmark on CUDA.

One GPU runs the gloo-on-CUDA checks (gloo, unlike NCCL, takes two ranks of
one group on one GPU); NCCL across groups needs a GPU per group, given to
each group by CUDA_VISIBLE_DEVICES. Options that the examples and the
benchmark grew for CUDA are read from their --help: one missing fails (or,
for a choice with no other way to make it, skips) the check, naming it.
Every process has a deadline, and the `children` fixture kills every tree."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_gone_abort import MAX_STALL_S, commits, stall_around
from tests.e2e.test_kill_and_recover import finals, last_step, start_lighthouse, steps, stop_at
from tests.gpu.conftest import device_used, need_gpus
from tests.procs import PYTHON, REPO
from tests.waiting import wait_until
from tools.procs import kill_tree, read_jsonl

pytestmark = pytest.mark.cuda

TRAIN = "examples/train_ddp.py"
PG_FLAGS = ("--process-group", "--pg", "--backend")
"""Where a script may take its process group choice."""
GROUP_GPU_MIB = 64
"""Each training group holds at least this much GPU memory (its CUDA
context alone is more): less means it trained on the CPU."""


@functools.cache
def help_text(*args: str) -> str:
    """`python ARGS --help`, bounded; "" if it fails."""
    try:
        out = subprocess.run([PYTHON, *args, "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=90)  # fmt: skip
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout if out.returncode == 0 else ""


def choice(help: str, value: str) -> list[str] | None:
    """The option (of PG_FLAGS) that chooses `value`, e.g. ["--pg", "nccl"];
    None if the script has none of them. Fails if one exists without `value`."""
    for flag in PG_FLAGS:
        m = re.search(rf"{re.escape(flag)} \{{([^}}]*)\}}", help)
        if m:
            choices = m.group(1).split(",")
            assert value in choices, f"{flag} offers {choices}, not {value!r}"
            return [flag, value]
    return None


def device_flag(help: str, what: str) -> list[str]:
    assert "--device" in help, f"{what} has no --device option (or its --help failed)"
    return ["--device", "cuda"]


def train_args(pg: str) -> list[str]:
    """train_ddp.py's options for CUDA with process group `pg`. Without a
    choice option it picks by itself: gloo until NCCL was added, then
    torchft's rule (NCCL when CUDA is available)."""
    help = help_text(TRAIN)
    assert help, f"{TRAIN} --help failed"
    extra = device_flag(help, TRAIN) if "--device" in help else []
    return extra + (choice(help, pg) or [])


def start_group(children, tmp: Path, lighthouse: str, group: int, gpu: int, extra: list[str],
                transport: str = "http"):  # fmt: skip
    """A group of one rank on GPU `gpu`, training until its stop file says."""
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         TRAIN, "--steps", "100000", "--hidden", "256", "--step-sleep", "0.05",
         "--stop-file", str(tmp / f"group{group}.stop"), "--transport", transport,
         "--log-json", str(tmp / f"group{group}.jsonl"), *extra],
        log=tmp / f"group{group}.log",
        env={"TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(group),
             "NUM_REPLICA_GROUPS": "2", "TORCHFT_TIMEOUT_SEC": "10",
             "CUDA_VISIBLE_DEVICES": str(gpu)},
    )  # fmt: skip


def tail(tmp: Path, group: int) -> str:
    path = tmp / f"group{group}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def running(procs: list, tmp: Path) -> bool:
    """True; fails at once, with its log, if a group's process has exited."""
    for group, proc in enumerate(procs):
        assert proc.poll() is None, f"group {group} exited {proc.returncode}:\n{tail(tmp, group)}"
    return True


def gpus_used(gpus: list[int]) -> int:
    return sum(device_used(g) for g in gpus)


def together(path: Path) -> int:
    return sum(r["participants"] == 2 and r["committed"] for r in steps(path))


def end_together(tmp: Path, procs: list, figure) -> None:
    """Stops both groups at one step; their final states must be bit-identical."""
    final = last_step(tmp / "group0.jsonl") + 10
    for group in (0, 1):
        stop_at(tmp, group, final)
    for group, proc in enumerate(procs):
        assert proc.wait(timeout=90) == 0, f"group {group} failed:\n{tail(tmp, group)}"
    ends = finals(tmp)
    figure("final_step", final)
    figure("final_hashes", [r["hash"] for r in ends])
    assert {(r["step"], r["hash"]) for r in ends} == {(final, ends[0]["hash"])}, (
        f"replicas are not bit-identical at step {final}: {ends}"
    )


@pytest.mark.timeout(130)
@pytest.mark.parametrize("variant", ["gloo_cuda", "nccl_pg"])
def test_killed_group_heals_bit_identical(children, tmp_path, figure, variant) -> None:
    """gloo_cuda: both groups on GPU 0 over gloo, healing over HTTP.
    nccl_pg: a GPU per group, NCCL between them, healing over NCCL (PGTransport)."""
    pg, gpus, transport = ("gloo", [0, 0], "http")
    if variant == "nccl_pg":
        pg, gpus, transport = ("nccl", [0, 1], "pg")
    if pg == "nccl":
        need_gpus(2)
    extra = train_args(pg)
    figure("train_args", extra)
    before = gpus_used(sorted(set(gpus)))
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    procs = [start_group(children, tmp_path, lighthouse, g, gpus[g], extra, transport)
             for g in (0, 1)]  # fmt: skip
    log0, log1 = tmp_path / "group0.jsonl", tmp_path / "group1.jsonl"

    def trained() -> bool:
        return running(procs, tmp_path) and last_step(log1) >= 15 and together(log1) >= 5

    wait_until(trained, 90, "both groups to train together")
    held = (gpus_used(sorted(set(gpus))) - before) >> 20
    figure("groups_gpu_mib", held)
    assert held >= 2 * GROUP_GPU_MIB, f"the groups hold {held} MiB of GPU memory: on the CPU?"
    assert not kill_tree(procs[1].pid), "the victim's processes survived SIGKILL"
    killed_at = time.time()
    time.sleep(1.0)
    restarted_at = time.time()
    procs[1] = start_group(children, tmp_path, lighthouse, 1, gpus[1], extra, transport)

    def recommitted() -> bool:
        return running(procs, tmp_path) and any(
            r["t"] > killed_at and r["committed"] for r in steps(log1)
        )

    wait_until(recommitted, 60, lambda: f"the restarted group to commit:\n{tail(tmp_path, 1)}")
    end_together(tmp_path, procs, figure)
    after = [r for r in steps(log1) if r["t"] > killed_at]
    assert after[0]["healed"], "the restarted group did not heal first"
    first_commit = next(r for r in after if r["committed"])
    figure("restart_to_commit_s", round(first_commit["t"] - restarted_at, 2))
    figure("heal_recv_s", after[0].get("heal_recv_s"))
    outage = [r for r in steps(log0) if killed_at < r["t"] < after[0]["t"] and r["committed"]]
    figure("survivor_commits_during_outage", len(outage))
    assert outage, "the survivor stopped committing while its peer was down"


@pytest.mark.timeout(100)
def test_nccl_across_groups(children, tmp_path, figure) -> None:
    need_gpus(2)
    extra = train_args("nccl")
    figure("train_args", extra)
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    procs = [start_group(children, tmp_path, lighthouse, g, g, extra) for g in (0, 1)]
    log0 = tmp_path / "group0.jsonl"
    wait_until(lambda: running(procs, tmp_path) and together(log0) >= 20, 80, "20 steps together")
    both = [r["step_s"] for r in steps(log0) if r["participants"] == 2 and r["committed"]]
    figure("step_ms_median", round(1000 * statistics.median(both[5:] or both), 2))
    end_together(tmp_path, procs, figure)


@pytest.mark.timeout(60)
def test_http_heal_of_cuda_state(figure) -> None:
    """256 MB, sent from the GPU and received onto it, beside the same state
    on the CPU; the best of 3 fetches each (the first pays for connections)."""
    from torchft_like.checkpointing import HTTPTransport

    gen = torch.Generator().manual_seed(0)
    cpu_state = {f"w{i}": torch.randn(16 << 20, generator=gen) for i in range(4)}
    nbytes = sum(t.numel() * t.element_size() for t in cpu_state.values())
    cuda_state = {k: v.to("cuda:0") for k, v in cpu_state.items()}
    timeout = timedelta(seconds=60)

    def heal(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        source = HTTPTransport(timeout=timeout, hostname="127.0.0.1")
        healer = HTTPTransport(timeout=timeout, hostname="127.0.0.1")
        try:
            source.send_checkpoint([1], 7, state, timeout)
            best = float("inf")
            for _ in range(3):
                start = time.monotonic()
                got = healer.recv_checkpoint(0, source.metadata(), 7, timeout)
                torch.cuda.synchronize()
                best = min(best, time.monotonic() - start)
            return got, nbytes / best / 1e6
        finally:
            source.shutdown()
            healer.shutdown()

    got_cuda, cuda_mbps = heal(cuda_state)
    got_cpu, cpu_mbps = heal(cpu_state)
    figure("state_mb", round(nbytes / 1e6))
    figure("cuda_MBps", round(cuda_mbps))
    figure("cpu_MBps", round(cpu_mbps))
    figure("received_on", sorted({str(t.device) for t in got_cuda.values()}))
    for key, want in cuda_state.items():
        assert got_cuda[key].is_cuda, f"{key} arrived on {got_cuda[key].device}, not the GPU"
        assert torch.equal(got_cuda[key], want), f"{key} differs after the heal"
        assert torch.equal(got_cpu[key], cpu_state[key])


@pytest.mark.timeout(130)
def test_demo_on_cuda(children, tmp_path, figure) -> None:
    help = help_text("examples/demo.py")
    out = tmp_path / "demo"
    proc = children.spawn(
        [PYTHON, "examples/demo.py", *device_flag(help, "examples/demo.py"), "--steps", "60",
         "--hidden", "64", "--out", str(out), "--timeout", "100"],
        log=tmp_path / "demo.log",
    )  # fmt: skip
    rc = proc.wait(timeout=115)
    text = (tmp_path / "demo.log").read_text(errors="replace")
    assert rc == 0, f"the demo exited {rc}:\n{text[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    victim: dict[str, Any] = next((r for r in summary["groups"] if "restart_to_commit_s" in r), {})
    figure("identical", summary["identical"])
    figure("restart_to_commit_s", victim.get("restart_to_commit_s"))
    figure("final_hashes", [r["hash"] for r in summary["groups"]])
    assert summary["identical"], "the demo's replicas did not end bit-identical"


@pytest.mark.timeout(130)
@pytest.mark.parametrize("pg", ["gloo", "nccl"])
def test_step_overhead_on_cuda(children, tmp_path, figure, pg) -> None:
    """A short run (4 interleaved rounds of 10 steps, 4M parameters): a
    figure, not a target; bench/NOTES.md says what a full run takes."""
    if pg == "nccl":
        need_gpus(2)
    help = help_text("-m", "bench.step_overhead")
    picked = choice(help, pg)
    if picked is None and pg == "nccl":
        pytest.skip("bench.step_overhead --help offers no NCCL choice: step cost on NCCL not run")
    args = ["-m", "bench.step_overhead", *device_flag(help, "bench.step_overhead"),
            *(picked or []), "--hidden", "1000", "--rounds", "4", "--steps", "10",
            "--warmup", "3", "--contenders", "plain", "ft", "--allocator", "default",
            "--out", str(tmp_path / "results")]  # fmt: skip
    figure("ran", " ".join(["python", *args[:-2]]))
    proc = children.spawn([PYTHON, *args], log=tmp_path / "bench.log")
    rc = proc.wait(timeout=120)
    text = (tmp_path / "bench.log").read_text(errors="replace")
    assert rc == 0, f"bench.step_overhead exited {rc}:\n{text[-3000:]}"
    rows = read_jsonl(tmp_path / "results" / "step_overhead.jsonl")
    assert rows, f"no results:\n{text[-3000:]}"
    row = rows[-1]
    for key in ("ft_ratio", "ft_ci95", "ft_ratio_cpu", "plain_ms", "ft_ms"):
        figure(key, row.get(key))
    assert isinstance(row.get("ft_ratio"), float), row


@pytest.mark.timeout(100)
@pytest.mark.parametrize("pg", ["nccl"])
def test_kill_inside_allreduce_survivor_aborts(children, tmp_path, figure, pg) -> None:
    """Group 1 holds inside an NCCL allreduce and is SIGKILLed there; group 0
    must go on within MAX_STALL_S (the gone notice aborts its communicator),
    far below its 30 s collective timeout."""
    need_gpus(2)
    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    hold = tmp_path / "held"
    procs = []
    for group in (0, 1):
        log = str(tmp_path / f"g{group}.jsonl")
        args = [PYTHON, "-m", "tests.gpu.test_gpu_groups", "--lighthouse", lighthouse,
                "--group", str(group), "--pg", pg, "--log", log]  # fmt: skip
        if group == 1:
            args += ["--hold-after", "5", "--hold-file", str(hold)]
        procs.append(children.spawn(args, log=tmp_path / f"group{group}.log",
                                    env={"CUDA_VISIBLE_DEVICES": str(group)}))  # fmt: skip
    wait_until(lambda: running(procs, tmp_path) and hold.exists(), 90, "the victim to hold")
    assert not kill_tree(procs[1].pid)
    fault_t = float(hold.read_text())
    survivor = tmp_path / "g0.jsonl"

    def went_on() -> bool:
        return (
            running(procs[:1], tmp_path) and sum(r["t"] > fault_t for r in commits(survivor)) >= 5
        )

    wait_until(went_on, 45, lambda: f"the survivor to go on:\n{tail(tmp_path, 0)}")
    stall_s = stall_around(commits(survivor), fault_t)
    figure("survivor_stall_s", round(stall_s, 3))
    figure("bound_s", MAX_STALL_S)
    assert stall_s <= MAX_STALL_S, f"the survivor stalled {stall_s:.2f} s"


def worker(argv: list[str]) -> None:
    """One replica group of one rank on the GPU CUDA_VISIBLE_DEVICES names
    (tests/e2e/_stall_worker.py's, on CUDA): a Manager, our DDP, a JSON line
    per step. With --hold-after K it stops inside the allreduce after K
    steps with both groups, writing --hold-file, until it is killed."""
    from torch import nn
    from torch.distributed import TCPStore

    from torchft_like import DistributedDataParallel, Manager, Optimizer
    from torchft_like.process_group import ProcessGroupBabyNCCL, ProcessGroupNCCL

    p = argparse.ArgumentParser(allow_abbrev=False)
    for name in ("--lighthouse", "--log", "--hold-file"):
        p.add_argument(name)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--pg", choices=("nccl", "baby_nccl"), default="nccl")
    p.add_argument("--hold-after", type=int, default=None)
    args = p.parse_args(argv)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    timeout = timedelta(seconds=30)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(dev)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    pg = (ProcessGroupNCCL if args.pg == "nccl" else ProcessGroupBabyNCCL)(timeout)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["m"])
        inner.load_state_dict(sd["o"])

    manager = Manager(
        pg=pg, min_replica_size=1, timeout=timeout, quorum_timeout=timedelta(seconds=60),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        connect_timeout=timedelta(seconds=10), rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        replica_id=f"gpu_{args.group}", max_retries=1000,
    )  # fmt: skip
    both = 0
    if args.hold_after is not None:
        allreduce = manager.allreduce

        def held(tensor: Any, *rest: Any, **kwargs: Any) -> Any:
            if both >= args.hold_after:
                Path(args.hold_file + ".tmp").write_text(str(time.time()))
                os.replace(args.hold_file + ".tmp", args.hold_file)
                time.sleep(3600)  # inside the step's collectives, until killed
            return allreduce(tensor, *rest, **kwargs)

        manager.allreduce = held  # type: ignore[method-assign]
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    gen = torch.Generator().manual_seed(args.group)
    with open(args.log, "a") as log:
        while True:
            x = torch.randn(16, 32, generator=gen).to(dev)
            optimizer.zero_grad()
            ddp(x).pow(2).mean().backward()
            before = manager.current_step()
            optimizer.step()
            committed = manager.current_step() > before
            state = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
            record = {"t": time.time(), "step": manager.current_step(), "committed": committed,
                      "participants": manager.num_participants(),
                      "hash": hashlib.sha256(state).hexdigest()[:16]}  # fmt: skip
            both += committed and record["participants"] == 2
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(0.02)


if __name__ == "__main__":
    worker(sys.argv[1:])
