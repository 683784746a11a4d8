"""Spares and standbys: replacement replica groups that have already started.

A cold restart spends seconds before it can heal: torchrun, the interpreter,
`import torch`, building the model and optimizer. A standby does all of that
ahead of time and then waits here; the supervisor that would have
cold-started the replacement for a dead group writes that group's id into the
standby's file instead, and the standby joins the next quorum and heals.

The file is the whole protocol: write the id to a temporary file and rename it
over `path`, so no rank reads it half written. Every rank of the standby's
torchrun reads the same file. Once a standby is taken, start a new one.

A hot spare needs no supervisor: it asks the lighthouse (take_replica_group),
which hands it the place of the next group that dies.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from lighthouse.client import LIGHTHOUSE_ENV, LighthouseClient
from lighthouse.core.jobs import JOB_ENV
from lighthouse.rpc import auth
from lighthouse.rpc.tls import tls_from_env


def take_replica_group(
    wanted: str = "",
    lighthouse_addr: str | None = None,
    spare_id: str | None = None,
    timeout: timedelta | None = None,
) -> str:
    """Blocks until the lighthouse lets this process train as a replica
    group; returns the group's name (the Manager's `replica_id`).

    `wanted` (e.g. this group's own name, on a restart) is granted when no
    live replica has it; otherwise this process waits as a hot spare and
    gets the name of the next group that dies. Every rank of one torchrun
    gets the same name: they share `spare_id`, by default made of torchrun's
    run id, restart count and store address. The secret and TLS come from the environment, as for
    the Manager, and so does the job (TORCHFT_JOB_ID).
    """
    addr = lighthouse_addr or os.environ.get(LIGHTHOUSE_ENV)
    if not addr:
        raise ValueError(
            f"no lighthouse address: pass lighthouse_addr or set {LIGHTHOUSE_ENV}, "
            "e.g. http://localhost:29510"
        )
    if spare_id is None:
        # The ranks of one torchrun share its store's address (chosen anew
        # by each rendezvous), its run id and its restart count.
        keys = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
        if all(key in os.environ for key in keys):
            spare_id = "/".join(os.environ[key] for key in keys)
        else:
            spare_id = f"{socket.gethostname()}/{os.getpid()}"
    client = LighthouseClient(
        addr,
        secret=auth.load_secret(),
        tls=tls_from_env(os.environ),
        job_id=os.environ.get(JOB_ENV) or None,
    )
    try:
        return client.take_replica_group(spare_id, wanted, timeout)
    finally:
        client.close()


def wait_for_replica_group(path: str | os.PathLike[str], poll_s: float = 0.01) -> int:
    """Blocks until `path` holds a replica group id (a non-negative integer)
    and returns it. Raises ValueError, naming the file and its content, if it
    holds anything else: a standby must not guess which group it replaces."""
    while True:
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            time.sleep(poll_s)
            continue
        try:
            group = int(text.strip())
        except ValueError:
            group = -1
        if group < 0:
            raise ValueError(
                f"standby file {os.fspath(path)!r} holds {text[:80]!r}, not a replica group id: "
                "write the id of the group this standby replaces, e.g. 1 (to a temporary "
                "file, then rename it over this one)"
            )
        return group
