"""The reference contender of bench.recovery: examples/train_ddp.py's model,
data and schedule on pytorch/torchft (never imported by the library).

Launched by torchrun like train_ddp.py, with the same flags it needs and the
same JSON lines (start, step, final), so bench.recovery reads both alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from datetime import timedelta

START_TIME = time.time()
# Start-up creates millions of long-lived objects (torch, then torch._dynamo
# when the first optimizer is built), and the collector would walk them again
# and again: about a fifth of the start-up CPU. Collect nothing until the
# loop, then freeze them out of the collector's way.
gc.disable()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

TORCH_TIME, TORCH_CPU = time.time(), time.process_time()

from torchft import (  # noqa: E402
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
)

from torchft_like.manager.fingerprint import fingerprint  # noqa: E402

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=500)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--log-json", default=None)
parser.add_argument("--timeout-s", type=float, default=10)
parser.add_argument("--stop-file", default=None)
args = parser.parse_args()

GROUP = int(os.environ.get("REPLICA_GROUP_ID", 0))
NUM_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
RANK = int(os.environ.get("RANK", 0))
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s group{GROUP} %(name)s: %(message)s")

# --- the same data and model as examples/train_ddp.py -----------------------

NUM_FEATURES, NUM_CLASSES, NUM_SAMPLES = 64, 10, 8192
gen = torch.Generator().manual_seed(args.seed)
inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=gen)
labels = (inputs @ teacher).argmax(dim=1)
dataset = TensorDataset(inputs, labels)
sampler = DistributedSampler(
    dataset,
    replica_rank=GROUP,
    num_replica_groups=NUM_GROUPS,
    group_rank=RANK,
    num_replicas=int(os.environ.get("WORLD_SIZE", 1)),
    seed=args.seed,
)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

torch.manual_seed(args.seed)
layers: list[nn.Module] = [nn.Linear(NUM_FEATURES, args.hidden), nn.ReLU()]
for _ in range(args.layers - 1):
    layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
layers.append(nn.Linear(args.hidden, NUM_CLASSES))
model = nn.Sequential(*layers)
inner_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def load_state_dict(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner_optimizer.load_state_dict(state["optim"])


def state_dict() -> dict:
    return {"model": model.state_dict(), "optim": inner_optimizer.state_dict()}


timeout = timedelta(seconds=args.timeout_s)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    min_replica_size=1,
    replica_id=f"train_ddp_{GROUP}",
    timeout=timeout,
    quorum_timeout=timedelta(seconds=60),
    connect_timeout=timedelta(seconds=10),
    max_retries=50,
)
manager_time = time.time()
ddp_model = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, inner_optimizer)
criterion = nn.CrossEntropyLoss()
json_log = open(args.log_json, "a") if args.log_json and RANK == 0 else None
ready_time, ready_cpu = time.time(), time.process_time()

# Time the state transfer: torchft receives it inside its quorum thread.
timings: dict[str, float] = {}
_recv = manager._checkpoint_transport.recv_checkpoint


def timed_recv(*a, **kw):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        return _recv(*a, **kw)
    finally:
        timings["heal_recv_s"] = time.monotonic() - start


manager._checkpoint_transport.recv_checkpoint = timed_recv  # type: ignore[method-assign]


def state_hash() -> str:
    """Fingerprint of the model and optimizer state: equal only if bit-identical."""
    return fingerprint(
        {"model": model.state_dict(), "optim": inner_optimizer.state_dict()["state"]}
    )


def emit(record: dict) -> None:
    if json_log is not None:
        json_log.write(json.dumps(record) + "\n")
        json_log.flush()


emit(
    {
        "event": "start",
        "t": START_TIME,
        "torch_imported": TORCH_TIME,
        "manager_ready": manager_time,
        "ready": ready_time,
        "cpu_torch_imported": TORCH_CPU,
        "cpu_ready": ready_cpu,
    }
)


def total_steps() -> int:
    if args.stop_file:
        try:
            return int(open(args.stop_file).read())
        except (OSError, ValueError):
            pass
    return args.steps


gc.freeze()
gc.enable()
epoch = 0
batches = iter(loader)
while manager.current_step() < total_steps():
    try:
        x, y = next(batches)
    except StopIteration:
        epoch += 1
        sampler.set_epoch(epoch)
        batches = iter(loader)
        continue
    step_start = time.time()
    timings.clear()
    optimizer.zero_grad()
    quorum_start = time.monotonic()
    assert manager._quorum_future is not None
    manager._quorum_future.add_done_callback(
        lambda _f, s=quorum_start: timings.setdefault("quorum_done_s", time.monotonic() - s)
    )
    loss = criterion(ddp_model(x), y)
    loss.backward()
    step_before = manager.current_step()
    optimizer.step()
    committed = manager.current_step() > step_before
    quorum_s = timings.get("quorum_done_s", 0.0) - timings.get("heal_recv_s", 0.0)
    emit(
        {
            "event": "step",
            "t": time.time(),
            "step_s": time.time() - step_start,
            "step": manager.current_step(),
            "loss": loss.item(),
            "participants": manager.num_participants(),
            "committed": committed,
            "healed": "heal_recv_s" in timings,
            "quorum_s": quorum_s,
            **({"heal_recv_s": timings["heal_recv_s"]} if "heal_recv_s" in timings else {}),
        }
    )
    if args.step_sleep:
        time.sleep(args.step_sleep)

final_hash = state_hash()
emit({"event": "final", "t": time.time(), "step": manager.current_step(), "hash": final_hash})
manager.shutdown(wait=False)
