"""Warm standby: a replacement replica group that has already started.

A cold restart spends seconds before it can heal: torchrun, the interpreter,
`import torch`, building the model and optimizer. A standby does all of that
ahead of time and then waits here; the supervisor that would have
cold-started the replacement for a dead group writes that group's id into the
standby's file instead, and the standby joins the next quorum and heals.

The file is the whole protocol: write the id to a temporary file and rename it
over `path`, so no rank reads it half written. Every rank of the standby's
torchrun reads the same file. Once a standby is taken, start a new one.
"""

from __future__ import annotations

import os
import time


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
