"""One rank of bench.step_overhead, launched by torchrun and driven over a socket.

    plain:   torch DDP over a gloo group of all ranks (torchrun's world).
    ft:      torchft_like DDP, this torchrun being one replica group.
    torchft: pytorch/torchft's DDP, the same way (reference only).

Every contender stays alive for the whole benchmark and trains only when the
driver tells it to: the driver connects to nobody, each rank connects to it
(--control HOST:PORT), says who it is, then obeys one JSON line at a time:
{"cmd": "run", "steps": N} trains N steps and answers with, per step, wall
seconds, CPU seconds of this process (all threads), minor page faults and
the wall of its zero_grad, forward, backward and optimizer step;
{"cmd": "profile", "dir": D} trains 5 steps under torch.profiler and writes
its table (rank 0); {"cmd": "stop"} exits. Between blocks a rank waits in a
blocking read, costing no CPU, so contenders take turns on the same cores
(interleaving at the block, not the launch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench import _rpc_count

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--mode", choices=["plain", "ft", "torchft"], required=True)
parser.add_argument("--name", required=True, help="the contender's name for the driver")
parser.add_argument("--control", required=True, help="HOST:PORT of the driver")
parser.add_argument("--hidden", type=int, required=True)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--pin", action="store_true", help="pin rank r (group g) to core r (g)")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--process-group", choices=["gloo", "nccl"], default="gloo")
args = parser.parse_args()
torch.set_num_threads(1)
_rpc_count.install()

group = os.environ.get("REPLICA_GROUP_ID", "0")
rank = int(os.environ.get("RANK", 0))
if args.pin:
    # One core per rank of the job (the rank for plain DDP, the group for
    # replica groups of one rank): the same placement for every contender.
    slot = rank if args.mode == "plain" else int(group)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[slot % len(cores)]})

# On CUDA, rank r of plain DDP and replica group g each take GPU r (g)
# modulo the GPUs: one GPU holds every rank over gloo; NCCL needs two.
device = torch.device("cpu")
if args.device == "cuda":
    slot = rank if args.mode == "plain" else int(group)
    device = torch.device("cuda", slot % torch.cuda.device_count())
    torch.cuda.set_device(device)
torch.manual_seed(0)
layers: list[nn.Module] = []
for _ in range(args.layers):
    layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
model = nn.Sequential(*layers).to(device)
inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(args.batch, args.hidden).to(device)


def make_pg(ft: object) -> object:
    """The replicas' group: gloo (on CUDA tensors too), or NCCL (ours)."""
    if args.process_group == "nccl":
        return ft.ProcessGroupNCCL(timeout=timedelta(seconds=120))  # type: ignore[attr-defined]
    return ft.ProcessGroupGloo(timeout=timedelta(seconds=120))  # type: ignore[attr-defined]


if args.mode == "plain":
    dist.init_process_group(args.process_group, timeout=timedelta(seconds=120))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = inner
    manager = None
else:
    if args.mode == "ft":
        import torchft_like as ft
    else:
        import torchft as ft  # type: ignore[no-redef]

    manager = ft.Manager(
        pg=make_pg(ft),
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        min_replica_size=2,
        replica_id=f"bench{group}",
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=600),
    )
    if args.mode == "torchft":
        # Its Rust client is out of grpc's reach: count the calls into it.
        rpcs = {"_quorum": "Quorum", "should_commit": "ShouldCommit"}
        manager._client = _rpc_count.CountingProxy(manager._client, rpcs)
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)


def train_step() -> tuple[float, ...]:
    """One step; returns when its zero_grad (the quorum's start), forward,
    backward and optimizer step ended (perf_counter): the wall of each phase."""
    optimizer.zero_grad()
    zero = time.perf_counter()
    loss = ddp(x).pow(2).mean()
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":  # the step ends when the GPU is done with it
        torch.cuda.synchronize(device)
    return zero, forward, backward, time.perf_counter()


def thread_cpu_ns() -> dict[str, int]:
    """CPU nanoseconds so far per kind of thread (schedstat: exact, unlike the
    tick-counted utime), named by Python's thread name or else the kernel's
    (grpc's and gloo's threads), numbers dropped: where a step's CPU goes."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "training"
    totals: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            name = names.get(int(tid))
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        label = re.sub(r"[-_ ]?\d+", "", name.split(" (")[0]) or "thread"
        totals[label] = totals.get(label, 0) + ns
    return totals


def run(steps: int) -> dict:
    times, cpu, minflt, phases = [], [], [], []
    rpcs_before = _rpc_count.snapshot()
    threads_before = thread_cpu_ns()
    for _ in range(steps):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c = time.process_time()
        t = time.perf_counter()
        ends = train_step()
        times.append(ends[-1] - t)
        cpu.append(time.process_time() - c)
        minflt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        phases.append([b - a for a, b in zip((t, *ends), ends)])
    rpcs = _rpc_count.critical_per_step(rpcs_before, _rpc_count.snapshot(), steps)
    threads = {
        name: (ns - threads_before.get(name, 0)) / 1e6 / steps
        for name, ns in thread_cpu_ns().items()
    }
    return {
        "times": times, "cpu": cpu, "minflt": minflt, "phases": phases, "rpcs_per_step": rpcs,
        "thread_cpu_ms": threads,
    }  # fmt: skip


def profile(directory: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(5):
            train_step()
    if rank == 0:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        name = args.name.replace("/", "_")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (out / f"{name}_h{args.hidden}.txt").write_text(table)
        prof.export_chrome_trace(str(out / f"{name}_h{args.hidden}.json"))
    return {}


host, port = args.control.rsplit(":", 1)
control = socket.create_connection((host, int(port)))
stream = control.makefile("rw")
stream.write(json.dumps({"name": args.name, "rank": rank, "group": group}) + "\n")
stream.flush()
for line in stream:
    cmd = json.loads(line)
    if cmd["cmd"] == "stop":
        break
    reply = run(cmd["steps"]) if cmd["cmd"] == "run" else profile(cmd["dir"])
    stream.write(json.dumps(reply if rank == 0 else {}) + "\n")
    stream.flush()

if manager is not None:
    manager.shutdown()
else:
    del ddp
    dist.destroy_process_group()
# Skip interpreter finalization: there, gloo's worker threads can still hold
# tensors and abort the process (SIGABRT, "terminate called without an active
# exception"; seen once in CI with plain DDP), failing a run whose results
# are already written.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
