"""One replica group of bench.goodput (torchrun, one rank): torchft_like or
pytorch/torchft, Manager + DistributedDataParallel over gloo, the MLP of
bench._goodput_data.

    torchft_like: the batch of each step from StepBatches over
        torchft_like.DistributedSampler (the Manager's committed data cursor
        decides which samples a step trains); with --spare, the process first
        asks the lighthouse which group to train as (a hot spare).
    torchft: as torchft's own train_ddp.py trains: its DistributedSampler
        shards the data over the replica groups, and the loop takes the next
        batch of its shard every iteration, whether or not the last step
        committed; a restarted group starts its shard again from the start
        (its example keeps no data position). Unlike the example the loop
        calls set_epoch, so each pass is a new order, as the other
        contenders' epochs are.

Logs JSON lines (--log-json): "spare_ready", then "start" (the group it trains
as), then per loop turn an "attempt" (the step it tries, the quorum id, the
epoch and, when this group counts in the step (not healing), the ids of its
samples) and a "step" (the committed step after it, whether it committed).
Exits at --deadline.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from datetime import timedelta
from typing import Any

PYTHON_START = time.time()  # the interpreter is up; torch not yet imported
gc.disable()  # start-up makes millions of long-lived objects; see examples/train_ddp.py

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench import _goodput_data as data  # noqa: E402

GROUP_NAME = "goodput_{}"

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--impl", choices=("torchft_like", "torchft"), required=True)
parser.add_argument("--log-json", required=True, help="JSON lines of this launch")
parser.add_argument("--deadline", type=float, required=True, help="exit at this Unix time")
parser.add_argument("--spare", action="store_true", help="torchft_like: a lighthouse-managed spare")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--timeout-s", type=float, default=5.0, help="collective/heal timeout")
parser.add_argument(
    "--step-sleep",
    type=float,
    default=0.0,
    help="seconds each step sleeps between forward and backward",
)
args = parser.parse_args()
data.exit_at(args.deadline)
torch.set_num_threads(1)
log = data.JsonLog(args.log_json)
NUM_GROUPS = int(os.environ["NUM_REPLICA_GROUPS"])

if args.impl == "torchft_like":
    import torchft_like as ft
    from torchft_like.standby import take_replica_group
else:
    import torchft as ft  # type: ignore[no-redef]

# Everything that does not depend on the group first: a spare has it done.
dataset = data.dataset(args.seed)
model = data.model(args.hidden, args.layers, args.seed)
inner = torch.optim.AdamW(model.parameters(), lr=args.lr)


def load_state_dict(state: dict[str, Any]) -> None:
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


def state_dict() -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": inner.state_dict()}


if args.spare:
    wanted = (
        GROUP_NAME.format(os.environ["REPLICA_GROUP_ID"])
        if "REPLICA_GROUP_ID" in os.environ
        else ""
    )
    log("spare_ready", wanted=wanted)
    name = take_replica_group(wanted)
    group = int(name.removeprefix(GROUP_NAME.format("")))
else:
    group = int(os.environ["REPLICA_GROUP_ID"])

taken = time.time()
sampler = ft.DistributedSampler(
    dataset, replica_rank=group, num_replica_groups=NUM_GROUPS, group_rank=0, num_replicas=1,
    shuffle=True, seed=args.seed,
)  # fmt: skip
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


timeout = timedelta(seconds=args.timeout_s)
manager = ft.Manager(
    pg=ft.ProcessGroupGloo(timeout=timeout),
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    min_replica_size=1,
    replica_id=GROUP_NAME.format(group),
    timeout=timeout,
    quorum_timeout=timedelta(seconds=60),
    connect_timeout=timedelta(seconds=10),
    max_retries=50,
)
manager_ready = time.time()
ddp = ft.DistributedDataParallel(manager, model)
optimizer = ft.Optimizer(manager, inner)
criterion = nn.CrossEntropyLoss()
log("start", group=group, python_start=PYTHON_START, taken=taken, manager_s=manager_ready - taken)


def quorum_id() -> int:
    return manager.quorum_id() if args.impl == "torchft_like" else manager._quorum_id


def train(ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor, epoch: int) -> None:
    """One step. Its samples are logged before the backward pass ("attempt",
    with the quorum, which the forward pass overlapped), its outcome after
    the vote ("step"): a group killed in between has its samples on record,
    and its gradients are in its peers' commit of that step if they have one."""
    optimizer.zero_grad()
    loss = criterion(ddp(x), y)
    time.sleep(args.step_sleep)  # stands for a device's compute: no host core
    before = manager.current_step()
    # A healing replica contributes zeros: its batch is not trained this step.
    trained = ids.tolist() if manager.is_participating() else []
    log("attempt", step=before + 1, quorum=quorum_id(), epoch=epoch, ids=trained)
    loss.backward()
    optimizer.step()
    log("step", step=manager.current_step(), committed=manager.current_step() > before)


gc.freeze()
gc.enable()
if args.impl == "torchft_like":
    batches = ft.StepBatches(manager, loader)
    while True:
        ids, x, y = next(batches)
        train(ids, x, y, batches.position().epoch)
else:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            train(ids, x, y, epoch)
        epoch += 1
