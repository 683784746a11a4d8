"""Shared by the benchmarks: print rows as a table and append them as JSON lines."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def report(rows: list[dict[str, Any]], results: str) -> None:
    """Prints `rows` (same keys each) as a table; appends them to `results`,
    a path relative to the repository, one JSON object a line."""
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r[k]).rjust(w) for k, w in zip(keys, widths)))
    out = REPO / results
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps({"time": time.time(), **r}) + "\n")
