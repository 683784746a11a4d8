"""How many of the project's source files one steady step runs, on group
rank 0 (which hosts the group's ManagerServer) and on another rank: the
files a newcomer follows to read a step.

    python -m bench.files_per_step [--world-size 2] [--json PATH]

A real lighthouse (in this process), one replica group of `--world-size`
ranks, each a process with a real Manager over gloo. Every thread of a rank
is profiled from before the Manager starts; files are counted during
`--steps` steady steps after `--warmup` (the quorum in place, nothing to
heal). Only files of the repository's packages count (lighthouse/,
torchft_like/), generated protobuf code excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._report import REPO, add_common_args, report, results_file


def rank_main(rank: int, world_size: int, lighthouse: str, store_port: int, args: Any) -> None:
    import torch

    from torchft_like import Manager, ProcessGroupGloo

    recording = threading.Event()
    files: set[str] = set()

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and recording.is_set():
            files.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda _: None,
        state_dict=lambda: {},
        min_replica_size=1,
        rank=rank,
        world_size=world_size,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id="files",
        timeout=timedelta(seconds=30),
        exit_with_parent=False,
    )
    tensor = torch.zeros(16)

    def step() -> None:
        manager.start_quorum()
        manager.allreduce(tensor).wait()
        assert manager.should_commit()

    for _ in range(args.warmup):
        step()
    recording.set()
    for _ in range(args.steps):
        step()
    recording.clear()
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    manager.shutdown()
    ours = sorted(
        str(Path(f).resolve().relative_to(REPO))
        for f in files
        if Path(f).resolve().is_relative_to(REPO)
        and Path(f).resolve().relative_to(REPO).parts[0] in ("lighthouse", "torchft_like")
        and "proto" not in Path(f).parts
    )
    print(json.dumps({"rank": rank, "files": ours}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    add_common_args(parser)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.warmup, args.steps = 2, 2
    if args.rank is not None:
        rank_main(args.rank, args.world_size, args.lighthouse, args.store_port, args)
        return

    from torch.distributed import TCPStore

    from lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    flags = {
        "--world-size": args.world_size,
        "--lighthouse": lighthouse.address(),
        "--store-port": store.port,
        "--warmup": args.warmup,
        "--steps": args.steps,
    }
    argv = [sys.executable, "-m", "bench.files_per_step"]
    argv += [str(x) for flag, value in flags.items() for x in (flag, value)]
    procs = [
        subprocess.Popen(
            [*argv, "--rank", str(r)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for r in range(args.world_size)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            p.kill()
        lighthouse.shutdown()
    for out in outs:
        print(f"rank {out['rank']}: {len(out['files'])} files")
        for f in out["files"]:
            print(f"  {f}")
    rows = [{"rank": out["rank"], "files": len(out["files"])} for out in outs]
    report(rows, results_file(args.out, "files_per_step"))
    if args.json:
        args.json.write_text(json.dumps(outs, indent=1))


if __name__ == "__main__":
    main()
