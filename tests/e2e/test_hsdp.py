"""FT-HSDP end to end: 2 replica groups x 2 ranks, real processes.

Each worker first trains torch's own HSDP (fully_shard over a 2-D mesh of
all 4 gloo ranks) for 20 AdamW steps, then, in the same process, leaves that
world and trains the same model on the same batches as rank r of replica
group g: its own 2-rank world shards the model, and the replicate dimension
goes through the Manager. After 20 committed steps every rank's shard must
match torch's within 1e-6 relative. Training goes on; group 1 is SIGKILLed,
restarted (new processes), heals per shard over PGTransport, and both
groups end at the same step with bit-identical shards.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)  # ~30 s on an idle 2-core machine, 90 s at load 10

EQUIV_STEPS = 20
DIM, HIDDEN, BATCH = 12, 15, 4  # 15 rows shard unevenly over 2 ranks: FSDP2 pads


def _build(mesh):  # noqa: ANN001, ANN202
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 3),
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batch(group: int, rank: int, step: int):  # noqa: ANN202
    import torch

    gen = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
    return torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, 3, generator=gen)


def _train_step(model, optimizer, group: int, rank: int, step: int):  # noqa: ANN001, ANN202
    x, y = _batch(group, rank, step)
    optimizer.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


def _shards(model, optimizer) -> dict:  # noqa: ANN001
    """This rank's local shards of the model and the optimizer state."""
    out = {f"model.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"optim.{index}.{key}"] = local.clone()
    return out


def _hash(shards: dict) -> str:
    digest = hashlib.sha256()
    for key in sorted(shards):
        digest.update(key.encode())
        digest.update(shards[key].contiguous().reshape(-1).view(-1).numpy().tobytes())
    return digest.hexdigest()[:16]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchft_like import Manager, Optimizer, ProcessGroupGloo
    from torchft_like.checkpointing.pg_transport import PGTransport
    from torchft_like.device_mesh import ft_init_device_mesh
    from torchft_like.hsdp import HSDPState

    torch.set_num_threads(1)
    g, r, out = args.group, args.rank, Path(args.out)
    timeout = timedelta(seconds=10)
    if args.ref_port:  # torch's own HSDP over all 4 ranks
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.ref_port}", rank=2 * g + r,
            world_size=4, timeout=timeout,
        )  # fmt: skip
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        model, optimizer = _build(mesh)
        for step in range(EQUIV_STEPS):
            _train_step(model, optimizer, g, r, step)
        torch.save(_shards(model, optimizer), out / f"ref_g{g}_r{r}.pt")
        del model, optimizer, mesh
        dist.destroy_process_group()

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.group_port}", rank=r, world_size=2,
        timeout=timeout,
    )  # fmt: skip
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        rank=r,
        world_size=2,
        store_addr="127.0.0.1",
        store_port=args.group_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"hsdp_{g}",
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timeout,
        checkpoint_transport=(
            PGTransport(pg, timeout, torch.device("cpu")) if args.transport == "pg" else None
        ),
    )
    mesh = ft_init_device_mesh(
        device_type="cpu", mesh_shape=(2, 2), mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0, manager=manager,
    )  # fmt: skip
    model, inner = _build(mesh)
    optimizer = Optimizer(manager, inner)
    state = HSDPState(model, inner)
    manager.set_state_dict_fns(state.load_state_dict, state.state_dict)
    stop_file = out / "stop"
    log = open(out / f"g{g}_r{r}.jsonl", "a")

    def last_step() -> int:
        try:
            return int(stop_file.read_text())
        except (OSError, ValueError):
            return 10**6

    while manager.current_step() < last_step():
        step = manager.current_step()
        loss = _train_step(model, optimizer, g, r, step)
        committed = manager.current_step() > step
        if committed and manager.current_step() == EQUIV_STEPS:
            torch.save(_shards(model, inner), out / f"ft_g{g}_r{r}.pt")
        record = {
            "step": manager.current_step(), "committed": committed, "healed": manager.did_heal(),
            "participants": manager.num_participants(), "loss": loss.item(),
        }  # fmt: skip
        log.write(json.dumps(record) + "\n")
        log.flush()
        time.sleep(args.step_sleep)
    final = {"final": manager.current_step(), "hash": _hash(_shards(model, inner))}
    log.write(json.dumps(final) + "\n")
    log.close()
    manager.shutdown()
    dist.destroy_process_group()


# ---- the test ----------------------------------------------------------------


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(condition, timeout: float, what: str, logs: list[Path], procs: list) -> None:  # noqa: ANN001
    from tests.waiting import wait_until

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in logs if p.exists())

    def met() -> bool:
        if condition():
            return True
        assert all(p.poll() is None for p in procs), f"a worker exited before {what}\n{tails()}"
        return False

    wait_until(met, timeout, lambda: f"{what}\n{tails()}")


def spawn_group(
    children, tmp_path: Path, lighthouse: str, group: int, ref_port: int = 0, transport: str = "pg"
) -> list:
    """The 2 ranks of one replica group, each a worker process of this module."""
    from tools.procs import free_port

    common = ["--group", str(group), "--group-port", str(free_port()),
              "--lighthouse", lighthouse, "--out", str(tmp_path), "--ref-port", str(ref_port),
              "--transport", transport]  # fmt: skip
    return [
        children.spawn(
            [sys.executable, "-m", "tests.e2e.test_hsdp", "--rank", str(r), *common],
            log=tmp_path / f"worker_g{group}_r{r}.log",
        )
        for r in range(2)
    ]


def test_ft_hsdp_matches_torch_hsdp_then_heals_per_shard_after_a_kill(children, tmp_path):
    import torch

    from tests.e2e.test_kill_and_recover import start_lighthouse
    from tools.procs import free_port, kill_tree

    # min 2: the first steps (compared with torch's HSDP) need both groups.
    lighthouse = start_lighthouse(
        children, heartbeat_timeout_ms=1000, extra=("--min-replicas", "2")
    )
    ref_port = free_port()
    logs = [tmp_path / f"worker_g{g}_r{r}.log" for g in range(2) for r in range(2)]

    def start(group: int, with_reference: bool) -> list:
        return spawn_group(children, tmp_path, lighthouse, group, ref_port if with_reference else 0)

    groups = {0: start(0, True), 1: start(1, True)}

    def last(g: int) -> int:
        return max((x.get("step", 0) for x in _records(tmp_path / f"g{g}_r0.jsonl")), default=0)

    _wait(lambda: last(1) >= EQUIV_STEPS + 3, 90, "group 1 past step 23", logs,
          groups[0] + groups[1])  # fmt: skip

    # torch's HSDP and FT-HSDP after the same 20 AdamW steps.
    for g in range(2):
        for r in range(2):
            ref = torch.load(tmp_path / f"ref_g{g}_r{r}.pt")
            ft = torch.load(tmp_path / f"ft_g{g}_r{r}.pt")
            assert ref.keys() == ft.keys()
            for key in ref:
                scale = ref[key].abs().max().clamp_min(1e-12)
                diff = (ref[key] - ft[key]).abs().max() / scale
                assert diff <= 1e-6, f"group {g} rank {r} {key}: relative difference {diff}"

    for proc in groups[1]:
        assert not kill_tree(proc.pid)
    killed_at = last(0)
    before = [len(_records(tmp_path / f"g1_r{r}.jsonl")) for r in range(2)]
    groups[1] = start(1, False)
    _wait(
        lambda: all(
            any(x.get("healed") for x in _records(tmp_path / f"g1_r{r}.jsonl")[before[r] :])
            for r in range(2)
        ),
        60, "the restarted group to heal", logs, groups[0] + groups[1],
    )  # fmt: skip
    for r in range(2):  # each restarted rank healed (its own shard) once, at the live step
        after = _records(tmp_path / f"g1_r{r}.jsonl")[before[r] :]
        healed = [x["step"] for x in after if x.get("healed")]
        assert len(healed) == 1 and healed[0] > killed_at, (r, after)
    stop_at = max(last(0), last(1)) + 3
    (tmp_path / "stop.tmp").write_text(str(stop_at))
    (tmp_path / "stop.tmp").rename(tmp_path / "stop")
    for proc in groups[0] + groups[1]:
        assert proc.wait(timeout=60) == 0, "\n".join(p.read_text()[-2500:] for p in logs)
    for r in range(2):
        finals = [_records(tmp_path / f"g{g}_r{r}.jsonl")[-1] for g in range(2)]
        assert finals[0] == finals[1] and finals[0]["final"] == stop_at, finals


# Three groups over the process group (whose heal picks one sender per
# shard), two over HTTP (three: test_kill_and_recover's DDP case); more
# cost the default suite 8-43 s each on two cores.
@pytest.mark.parametrize("transport, groups", [("http", 2), ("pg", 3)])
def test_an_fsdp2_group_joins_live_ones_and_a_killed_one_heals_per_shard(
    children, tmp_path, transport, groups
):
    """The last group joins the others once they train (it heals each shard
    from rank r of one live group), trains with them, is SIGKILLed and
    restarted, and heals again; every rank r ends bit-identical across
    groups. Over PGTransport rank r of exactly one live group sends."""
    from tests.e2e.test_kill_and_recover import start_lighthouse
    from tools.procs import kill_tree

    lighthouse = start_lighthouse(children, heartbeat_timeout_ms=1000)
    last_g = groups - 1
    logs = [tmp_path / f"worker_g{g}_r{r}.log" for g in range(groups) for r in range(2)]

    def start(group: int) -> list:
        return spawn_group(children, tmp_path, lighthouse, group, transport=transport)

    def records(g: int, r: int) -> list[dict]:
        return _records(tmp_path / f"g{g}_r{r}.jsonl")

    def last(g: int) -> int:
        return max((x.get("step", 0) for x in records(g, 0)), default=0)

    def healed_after(g: int, before: list[int]) -> bool:
        return all(any(x.get("healed") for x in records(g, r)[before[r] :]) for r in range(2))

    procs = {g: start(g) for g in range(last_g)}
    live = lambda: [p for ps in procs.values() for p in ps]  # noqa: E731
    _wait(lambda: min(last(g) for g in range(last_g)) >= 5, 60 + 15 * groups,
          "the first groups to train", logs, live())  # fmt: skip
    procs[last_g] = start(last_g)
    _wait(lambda: healed_after(last_g, [0, 0]) and last(last_g) >= last(0) - 1 > 0, 60,
          "the joining group to heal and train", logs, live())  # fmt: skip
    for proc in procs[last_g]:
        assert not kill_tree(proc.pid)
    before = [len(records(last_g, r)) for r in range(2)]
    procs[last_g] = start(last_g)
    _wait(lambda: healed_after(last_g, before), 60, "the restarted group to heal", logs, live())
    stop_at = max(last(g) for g in range(groups)) + 3
    (tmp_path / "stop.tmp").write_text(str(stop_at))
    (tmp_path / "stop.tmp").rename(tmp_path / "stop")
    for proc in live():
        assert proc.wait(timeout=60) == 0, "\n".join(p.read_text()[-2500:] for p in logs)
    for r in range(2):
        finals = [records(g, r)[-1] for g in range(groups)]
        assert all(f == finals[0] for f in finals) and finals[0]["final"] == stop_at, finals


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("--group", "--rank", "--group-port", "--ref-port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--transport", choices=("http", "pg"), default="pg")
    worker(parser.parse_args())
    sys.stdout.flush()
    os._exit(0)  # skip finalization, where gloo's threads can abort a finished process
