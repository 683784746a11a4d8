"""One rank of bench.goodput's checkpoint-restart contender: plain torch DDP
over gloo, no fault tolerance, under one `torchrun --max-restarts N`.

Every --every steps rank 0 saves the model, the optimizer and the data
position (epoch, batch) with torch.save to a temporary file and renames it
over --ckpt-dir/latest.pt. A start (the first, or torchrun's restart of every
worker after one died) resumes from that file: weights, optimizer and data
position, so the steps after it are trained again on the same samples.

Logs JSON lines to --rank-logs/rank{RANK}.jsonl: "start" (torchrun's restart
count, the step resumed at), one "step" per step before its backward pass
(the step, the epoch, the ids this rank trains, the restart count), and on
rank 0 "checkpoint" once a checkpoint is on disk. Exits at --deadline.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

PYTHON_START = time.time()  # the interpreter is up; torch not yet imported
gc.disable()  # as every bench.goodput worker: see examples/train_ddp.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from bench import _goodput_data as data  # noqa: E402

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--rank-logs", required=True)
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
parser.add_argument("--deadline", type=float, required=True, help="exit at this Unix time")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--timeout-s", type=float, default=30.0)
parser.add_argument(
    "--step-sleep", type=float, default=0.0, help="seconds each step sleeps after the forward pass"
)
args = parser.parse_args()
data.exit_at(args.deadline)
torch.set_num_threads(1)

dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
log = data.JsonLog(str(Path(args.rank_logs) / f"rank{rank}.jsonl"))

dataset = data.dataset(args.seed)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
model = data.model(args.hidden, args.layers, args.seed)
inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
ddp = nn.parallel.DistributedDataParallel(model)
criterion = nn.CrossEntropyLoss()

latest = Path(args.ckpt_dir) / "latest.pt"
step = epoch = batch = 0
if latest.exists():
    state = torch.load(latest, weights_only=True)
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])
    step, epoch, batch = state["step"], state["epoch"], state["batch"]
log("start", inc=incarnation, resumed=step, python_start=PYTHON_START)


def save() -> None:
    tmp = latest.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "optim": inner.state_dict(), "step": step,
         "epoch": epoch, "batch": batch},
        tmp,
    )  # fmt: skip
    os.replace(tmp, latest)
    log("checkpoint", step=step, inc=incarnation)


gc.freeze()
gc.enable()
while True:
    if batch >= len(loader):
        epoch, batch = epoch + 1, 0
    sampler.set_epoch(epoch)
    for ids, x, y in islice(loader, batch, None):
        inner.zero_grad()
        loss = criterion(ddp(x), y)
        time.sleep(args.step_sleep)  # stands for a device's compute: no host core
        # Before the allreduce: a rank killed once it has contributed has its samples on record.
        log("step", step=step + 1, epoch=epoch, ids=ids.tolist(), inc=incarnation)
        loss.backward()
        inner.step()
        step, batch = step + 1, batch + 1
        if rank == 0 and step % args.every == 0:
            save()
    epoch, batch = epoch + 1, 0
