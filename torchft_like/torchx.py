"""A TorchX component for a torchft_like job: one role per replica group.

Each role is one replica group: a `torchrun` of `script` with its own group
id, its share of the data (`NUM_REPLICA_GROUPS`) and torchrun's own restarts
(`max_restarts`), so a dead group is started again and heals from the
others while they train on. The lighthouse runs outside the app, as in
torchft (one per job, long-lived, on a small box); its address comes from
`lighthouse=` or `TORCHFT_LIGHTHOUSE`.

    torchft-lighthouse --min-replicas 1 --bind 127.0.0.1:29510 &
    torchx run -s local_cwd torchft_like/torchx.py:hsdp --replicas 2 \\
        --script examples/train_ddp.py -- --steps 200

The name and parameters are torchft's (`torchft.torchx:hsdp`), so a torchft
launch line moves with the module path changed. No `from __future__ import
annotations` here: TorchX reads the parameter types at run time.
"""

import os
from typing import Dict, Optional

import torchx.specs as specs

DEFAULT_LIGHTHOUSE = "http://localhost:29510"


def hsdp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "examples/train_ddp.py",
    env: Optional[Dict[str, str]] = None,
    image: str = "",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,  # noqa: N803 (torchx's name)
    lighthouse: Optional[str] = None,
) -> specs.AppDef:
    """Replica groups of `workers_per_replica` ranks each, training `script`.

    Args:
        script_args: arguments for `script`.
        replicas: number of replica groups (roles `replica_0` ...).
        workers_per_replica: ranks per group (torchrun's nproc_per_node).
        max_restarts: how often torchrun restarts a group that died.
        script: the training script each rank runs.
        env: extra environment for every rank.
        image: the scheduler's image (a directory for local_cwd).
        h: a named resource of the scheduler, instead of cpu/gpu/memMB.
        cpu: CPUs per rank.
        gpu: GPUs per rank.
        memMB: memory per rank in MB.
        lighthouse: the lighthouse URL (default: $TORCHFT_LIGHTHOUSE, else
            http://localhost:29510).
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: a job needs at least 1 replica group")
    if workers_per_replica < 1:
        raise ValueError(
            f"workers_per_replica={workers_per_replica}: a group needs at least 1 rank"
        )
    lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", DEFAULT_LIGHTHOUSE)
    roles = []
    for group in range(replicas):
        roles.append(
            specs.Role(
                name=f"replica_{group}",
                image=image,
                entrypoint="torchrun",
                args=[
                    # One node per group: --standalone picks a free rendezvous
                    # port, so groups on one host do not collide.
                    "--standalone",
                    f"--nproc-per-node={workers_per_replica}",
                    f"--max-restarts={max_restarts}",
                    script,
                    *script_args,
                ],
                env={
                    "TORCHFT_LIGHTHOUSE": lighthouse,
                    "REPLICA_GROUP_ID": str(group),
                    "NUM_REPLICA_GROUPS": str(replicas),
                    "OMP_NUM_THREADS": "1",
                    **(env or {}),
                },
                num_replicas=1,
                resource=specs.resource(
                    cpu=cpu * workers_per_replica,
                    gpu=gpu * workers_per_replica,
                    memMB=memMB * workers_per_replica,
                    h=h,
                ),
                max_retries=0,  # torchrun restarts the group; the scheduler need not
            )
        )
    return specs.AppDef(name="torchft-like", roles=roles)
