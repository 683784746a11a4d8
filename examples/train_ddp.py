"""Fault-tolerant data-parallel training of an MLP on generated data.

Start a lighthouse, then one torchrun per replica group:

    torchft-lighthouse --min-replicas 1 --bind 127.0.0.1:29510 --http-bind 127.0.0.1:29511
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 1 examples/train_ddp.py --steps 500
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 1 examples/train_ddp.py --steps 500

Kill either group (Ctrl-C or kill -9) and start it again: it copies the live
weights from the other group and rejoins; the other never stops.

A restart spends seconds starting up before it heals. To skip that, keep a
hot spare: start every group with --spare, and one more torchrun of this
script with --spare and no REPLICA_GROUP_ID. When a group dies, the
lighthouse hands its place to the spare at once; the dead group's restart
finds its place taken and becomes the next spare. (Without the lighthouse's
help: --standby-file FILE, and write the dead group's id there yourself:
echo 1 > FILE.tmp && mv FILE.tmp FILE.)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

START_TIME = time.time()  # before the heavy imports: start-up includes them
# Start-up creates millions of long-lived objects (torch, then torch._dynamo
# when the first optimizer is built), and the collector would walk them again
# and again: about a fifth of the start-up CPU. Collect nothing until the
# loop, then freeze them out of the collector's way.
gc.disable()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

TORCH_TIME, TORCH_CPU = time.time(), time.process_time()

from lighthouse import DuplicateGroupError, QuorumError  # noqa: E402
from torchft_like import (  # noqa: E402
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    StepBatches,
)
from torchft_like.checkpointing.durable import DurableCheckpointer  # noqa: E402
from torchft_like.checkpointing.pg_transport import PGTransport  # noqa: E402
from torchft_like.manager.fingerprint import fingerprint  # noqa: E402
from torchft_like.standby import take_replica_group, wait_for_replica_group  # noqa: E402

# --- arguments --------------------------------------------------------------

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
ENVIRONMENT = """\
environment (torchrun sets the first five; set the others):
  MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK   set by torchrun
  REPLICA_GROUP_ID            this group's id, an integer in [0, NUM_REPLICA_GROUPS)
  NUM_REPLICA_GROUPS          number of replica groups (default 2)
  TORCHFT_LIGHTHOUSE          lighthouse URL with its port, e.g. http://127.0.0.1:29510
  TORCHFT_MANAGER_PORT        port of rank 0's ManagerServer (default 0: any free one)
  TORCHFT_HOSTNAME            how peers on other machines reach this one: the address the
                              servers advertise (default: this machine's name)
  TORCHFT_BIND_HOST           host the servers listen on (default: TORCHFT_HOSTNAME;
                              0.0.0.0 or :: for all interfaces)
  TORCHFT_SECRET_FILE         file holding the job's shared secret (or TORCHFT_SECRET)
  TORCHFT_METRICS_PORT        serve Prometheus /metrics: local rank r on this port + r
                              (0: any free port, logged; default: off)
  TORCHFT_HEAL_SOURCES        up-to-date peers a healing rank fetches from at once
                              (default all; 1: one peer, as torchft)
  TORCHFT_TIMEOUT_SEC, TORCHFT_QUORUM_TIMEOUT_SEC, TORCHFT_CONNECT_TIMEOUT_SEC,
  TORCHFT_QUORUM_RETRIES      override the Manager's timeouts and retries

example: after `torchft-lighthouse --min-replicas 1 --bind 127.0.0.1:29510`, per group:
  TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
      torchrun --standalone --nproc_per_node 1 examples/train_ddp.py --steps 500
"""

parser = argparse.ArgumentParser(
    allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
    description=__doc__.split("\n")[0] + " Runs under torchrun, one process per rank.",
    epilog=ENVIRONMENT,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)
parser.add_argument("--steps", type=int, default=500, help="committed steps to train")
parser.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
parser.add_argument("--layers", type=int, default=3, help="hidden layers of the MLP")
parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
parser.add_argument("--log-json", default=None, help="append one JSON line per step here")
parser.add_argument("--timeout-s", type=float, default=10, help="collective/transfer timeout")
parser.add_argument(
    "--fingerprint-every",
    type=int,
    default=10,
    help="compare a fingerprint of the state across replicas every K committed steps; "
    "a divergent replica heals (0: off)",
)
parser.add_argument(
    "--stop-file",
    default=None,
    help="also stop once the committed step reaches the number written in this file "
    "(a driver ends every group of one quorum at the same step)",
)
parser.add_argument(
    "--standby-file",
    default=None,
    help="start as a warm standby: do all of start-up, then wait until a supervisor writes "
    "the id of the replica group to replace into this file, and train as that group "
    "(REPLICA_GROUP_ID is then ignored)",
)
parser.add_argument(
    "--spare",
    action="store_true",
    help="start as a hot spare managed by the lighthouse: do all of start-up, then train as "
    "REPLICA_GROUP_ID if that group has no live replica, else (or without REPLICA_GROUP_ID) "
    "wait until a group dies and the lighthouse hands this process its place",
)
parser.add_argument(
    "--checkpoint-dir",
    default=None,
    help="durable checkpoints here (shared by every group); a start resumes from the newest "
    "complete one",
)
parser.add_argument(
    "--checkpoint-every", type=int, default=100, help="committed steps between checkpoints"
)
parser.add_argument("--checkpoint-keep", type=int, default=2, help="checkpoints kept per rank")
parser.add_argument(
    "--loader",
    choices=("plain", "stateful"),
    default="plain",
    help="torch's DataLoader, or torchdata's StatefulDataLoader; either way over "
    "torchft_like.DistributedSampler, so StepBatches trains every sample of an epoch once",
)
parser.add_argument(
    "--transport",
    choices=("http", "pg"),
    default="http",
    help="how a healing group copies the live state: http (HTTPTransport, striped over every "
    "up-to-date group) or pg (PGTransport over the replicas' process group, one source)",
)
parser.add_argument(
    "--device",
    choices=("auto", "cpu", "cuda"),
    default="auto",
    help="where the model trains: auto is cuda (cuda:LOCAL_RANK) when CUDA is available, else cpu",
)
parser.add_argument(
    "--process-group",
    choices=("auto", "gloo", "nccl", "baby-nccl"),
    default="auto",
    help="the replicas' process group: auto is torchft's rule (ProcessGroupBabyNCCL on "
    "cuda, else ProcessGroupGloo); gloo takes CUDA tensors too (one GPU can hold two groups); "
    "NCCL needs a GPU per group",
)
args = parser.parse_args()
if missing := [name for name in TORCHRUN_ENV if name not in os.environ]:
    parser.exit(
        2,
        f"train_ddp.py: error: {', '.join(missing)} not set: this script runs under torchrun, "
        f"which sets {', '.join(TORCHRUN_ENV)}; start it as\n"
        "  TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 "
        "torchrun --standalone --nproc_per_node 1 examples/train_ddp.py\n"
        "(see --help for every variable it reads)\n",
    )

REPLICA_GROUP_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
RANK = int(os.environ.get("RANK", 0))
torch.set_num_threads(1)
if args.device == "cuda" and not torch.cuda.is_available():
    parser.exit(2, "train_ddp.py: error: --device cuda, but torch.cuda.is_available() is False\n")
if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)  # NCCL and the checkpoint transport use the current device
else:
    device = torch.device("cpu")


def log_as(group: str) -> None:
    """Prefixes every log line with the group and rank (a standby's group is
    known only once it takes over)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s group{group}/rank{RANK} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


if args.spare and REPLICA_GROUP_ID_ENV not in os.environ:
    log_as("spare")
else:
    log_as("standby" if args.standby_file else os.environ.get(REPLICA_GROUP_ID_ENV, "?"))
log = logging.getLogger("train_ddp")

# --- data: a fixed random teacher network labels random inputs --------------

NUM_FEATURES, NUM_CLASSES, NUM_SAMPLES = 64, 10, 8192
gen = torch.Generator().manual_seed(args.seed)
inputs = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
teacher = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=gen)
labels = (inputs @ teacher).argmax(dim=1)
# Each sample carries its id, so the per-step log shows which samples a commit trained.
dataset = TensorDataset(torch.arange(NUM_SAMPLES), inputs, labels)

# --- model, manager, optimizer ----------------------------------------------

torch.manual_seed(args.seed)
layers: list[nn.Module] = [nn.Linear(NUM_FEATURES, args.hidden), nn.ReLU()]
for _ in range(args.layers - 1):
    layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
layers.append(nn.Linear(args.hidden, NUM_CLASSES))
model = nn.Sequential(*layers).to(device)
inner_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def load_state_dict(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner_optimizer.load_state_dict(state["optim"])


def state_dict() -> dict:
    return {"model": model.state_dict(), "optim": inner_optimizer.state_dict()}


def group_from_env() -> int:
    """REPLICA_GROUP_ID, checked: no default, since a forgotten variable would
    silently make a second group 0, training group 0's data shard twice."""
    try:
        group = int(os.environ[REPLICA_GROUP_ID_ENV])
    except (KeyError, ValueError):
        log.error(
            "%s=%r: it must be set to this replica group's id, an integer in "
            "[0, NUM_REPLICA_GROUPS), different for every group; e.g. %s=0 torchrun ... "
            "(or start a spare with --spare, or a warm standby with --standby-file)",
            REPLICA_GROUP_ID_ENV,
            os.environ.get(REPLICA_GROUP_ID_ENV),
            REPLICA_GROUP_ID_ENV,
        )
        sys.exit(2)
    if not 0 <= group < NUM_REPLICA_GROUPS:
        log.error(
            "%s=%d must be in [0, NUM_REPLICA_GROUPS=%d): each group trains its own shard; "
            "set NUM_REPLICA_GROUPS to the number of groups",
            REPLICA_GROUP_ID_ENV,
            group,
            NUM_REPLICA_GROUPS,
        )
        sys.exit(2)
    return group


GROUP_NAME = "train_ddp_{}"  # the Manager's replica_id: the lighthouse's name of a group

assigned_time = None
if args.spare:
    wanted = GROUP_NAME.format(group_from_env()) if REPLICA_GROUP_ID_ENV in os.environ else ""
    log.info(
        "spare: ready in %.2f s, asking the lighthouse for %s",
        time.time() - START_TIME,
        wanted or "the place of the next group that dies",
    )
    try:
        name = take_replica_group(wanted)
        REPLICA_GROUP_ID = int(name.removeprefix(GROUP_NAME.format("")))
    except (QuorumError, ValueError) as e:  # no spares served, refused, or a foreign name
        log.error("spare: %s", e)
        sys.exit(2)
    if name != wanted:
        assigned_time = time.time()
        log.info("spare: taking the place of replica group %d", REPLICA_GROUP_ID)
    log_as(str(REPLICA_GROUP_ID))
elif args.standby_file:
    log.info("standby: ready in %.2f s, waiting on %s", time.time() - START_TIME, args.standby_file)
    try:
        REPLICA_GROUP_ID = wait_for_replica_group(args.standby_file)
    except ValueError as e:
        log.error("%s", e)
        sys.exit(2)
    assigned_time = time.time()
    log_as(str(REPLICA_GROUP_ID))
    log.info("standby: replacing replica group %d", REPLICA_GROUP_ID)
else:
    REPLICA_GROUP_ID = group_from_env()
sampler = DistributedSampler(
    dataset, replica_rank=REPLICA_GROUP_ID, num_replica_groups=NUM_REPLICA_GROUPS, seed=args.seed
)
if args.loader == "stateful":
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
else:
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
timeout = timedelta(seconds=args.timeout_s)


def make_process_group(choice: str) -> Any:
    """torchft's rule for auto: ProcessGroupBabyNCCL on a GPU, else ProcessGroupGloo.
    The NCCL groups are imported only here, so a CPU run never touches them."""
    if choice == "auto":
        choice = "baby-nccl" if device.type == "cuda" else "gloo"
    if choice == "gloo":
        return ProcessGroupGloo(timeout=timeout)
    if device.type != "cuda":
        parser.exit(2, f"train_ddp.py: error: --process-group {choice} needs --device cuda\n")
    if choice == "nccl":
        from torchft_like.process_group import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=timeout)
    from torchft_like.process_group import ProcessGroupBabyNCCL

    return ProcessGroupBabyNCCL(timeout=timeout)


pg = make_process_group(args.process_group)
try:
    manager = Manager(
        pg=pg,
        checkpoint_transport=PGTransport(pg, timeout, device) if args.transport == "pg" else None,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=GROUP_NAME.format(REPLICA_GROUP_ID),
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        max_retries=50,
        fingerprint_interval=args.fingerprint_every or None,
    )
except (QuorumError, ValueError) as e:  # unreachable, refused, bad settings
    log.error("%s", e)
    sys.exit(2)
manager_time = time.time()
# The batch the quorum gives this group each step: unit batches_committed +
# our participating rank, so every sample of an epoch is trained once.
batches = StepBatches(manager, loader)
checkpointer = None
if args.checkpoint_dir:
    checkpointer = DurableCheckpointer(
        manager, args.checkpoint_dir, args.checkpoint_every, keep=args.checkpoint_keep
    )
    checkpointer.load_newest()  # before the first quorum: a whole-job restart resumes here
ddp_model = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, inner_optimizer)
criterion = nn.CrossEntropyLoss()
json_log = open(args.log_json, "a") if args.log_json and RANK == 0 else None
ready_time, ready_cpu = time.time(), time.process_time()
log.info("ready in %.2f s (replica %s)", ready_time - START_TIME, manager.replica_id)


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
        "assigned": assigned_time,  # a standby's takeover; None for a cold start
        "manager_ready": manager_time,
        "ready": ready_time,
        "cpu_torch_imported": TORCH_CPU,
        "cpu_ready": ready_cpu,
        "replica_id": manager.replica_id,
    }
)

# --- training loop ----------------------------------------------------------


def last_step() -> int:
    """--steps, or the step in --stop-file once a driver has written it."""
    try:
        with open(args.stop_file) as f:
            return min(args.steps, int(f.read()))
    except (TypeError, OSError, ValueError):  # no flag, no file yet, or half written
        return args.steps


gc.freeze()
gc.enable()
try:
    while manager.current_step() < last_step():
        ids, x, y = next(batches)
        position = batches.position()
        cursor = manager.batches_committed()
        x, y = x.to(device), y.to(device)
        step_start = time.time()
        optimizer.zero_grad()
        loss = criterion(ddp_model(x), y)
        loss.backward()
        step_before = manager.current_step()
        optimizer.step()
        committed = manager.current_step() > step_before
        if committed and checkpointer is not None:
            checkpointer.maybe_save()
        # A healing replica contributes zeros: its batch is not trained this step.
        rank = manager.participating_rank()
        healed = manager.did_heal()
        log.info(
            "step %d loss %.4f participants %d committed %s%s",
            manager.current_step(),
            loss.item(),
            manager.num_participants(),
            committed,
            " healed" if healed else "",
        )
        emit(
            {
                "event": "step",
                "t": time.time(),
                "step_s": time.time() - step_start,
                "step": manager.current_step(),
                "loss": loss.item(),
                "participants": manager.num_participants(),
                "committed": committed,
                "healed": healed,
                "quorum_id": manager.quorum_id(),
                # The samples this group contributed to the step (whether or not
                # its own vote committed: a peer's commit may have trained them),
                # the unit of data they are and the cursor the step began at.
                "sample_ids": ids.tolist() if rank is not None else [],
                "participating_rank": rank,
                "data_cursor": cursor,
                "data_unit": position.unit,
                "data_epoch": position.epoch,
                "data_batch": position.batch,
                **manager.timings(),
            }
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
except DuplicateGroupError as e:  # a second live group with our id: stop, loudly
    log.error("%s", e)
    sys.exit(2)

final_hash = state_hash()
log.info("finished at step %d, state hash %s", manager.current_step(), final_hash)
emit(
    {
        "event": "final",
        "t": time.time(),
        "step": manager.current_step(),
        "hash": final_hash,
        "quorum_id": manager.quorum_id(),  # groups in one last quorum must agree
    }
)
if checkpointer is not None:
    checkpointer.close()
manager.shutdown()
