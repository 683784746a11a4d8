"""The attacking host of bench.lighthouse_scale --attack, and what its runs report.

    python -m bench._scale_attack NAME ADDR [--round-s 3]

One process of its own runs one attack of tools/h2_attacks.py against the
lighthouse at ADDR again and again, each round with a fresh Budget (the
attack's own byte limit, --round-s seconds), each round's connections
closed before the next opens. Its peers connect from 127.0.0.2 when ADDR is
on 127.0.0.1: a host apart from the healthy load. It says "ready" once the
attack is prepared (Spec.prepare); the first line on stdin starts it, the
next (or the end of stdin) stops it: the round under way ends at once (its
budget is spent in place), its connections close, and the stats go to
stdout as one JSON line (bytes sent, rounds, errors such as connections
the lighthouse would not take, how its connections ended, its own CPU).
Bytes sent are what the kernel took from the attacker: against a server
that resets a flooding connection, much of it is never read.

The parent's side is `Attacker` (start, go, stop), with tools.procs.PeakRss;
`compare` puts a run without the attack beside the run with it and checks
the bench's criteria.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import psutil

from bench._report import REPO
from tools.h2_attacks import ATTACKS, Attack, Budget, raise_nofile

ROUND_S = 3.0
P99_SLACK = 1.25
"""The healthy quorum p99 under attack may be at most this times the p99 without."""
NOFILE = 8192
"""Open files for the attacker and the lighthouse (idle_connections opens 2,000)."""


class Rounds:
    """The attack, round after round, until `stop`."""

    def __init__(self, name: str, addr: str, round_s: float) -> None:
        self.spec = ATTACKS[name]
        self.addr = addr
        self.round_s = round_s
        self.stopped = threading.Event()
        self.budget: Budget | None = None
        self.out: dict[str, Any] = {
            "attack": name,
            "rounds": 0,
            "bytes_sent": 0,
            "errors": 0,
            "first_error": "",
            "notes": "",
            "endings": Counter[str](),
        }

    def stop(self) -> None:
        self.stopped.set()
        budget = self.budget
        if budget is not None:  # the round under way ends at its next check
            budget.max_bytes, budget.deadline = 0, time.monotonic()

    def run(self) -> None:
        out = self.out
        while not self.stopped.is_set():
            budget = self.budget = Budget(self.spec.max_bytes, self.round_s)
            if self.stopped.is_set():  # stopped before this budget could be spent
                break
            attack: Attack | None = None
            try:
                attack = self.spec.run(self.addr, budget)
                if not self.stopped.is_set():  # (the round cut short says little)
                    out["notes"] = attack.notes[:200]
                out["endings"].update(peer.state() for peer in attack.peers)
            except Exception as e:  # a connection the lighthouse would not take
                out["errors"] += 1
                out["first_error"] = out["first_error"] or repr(e)[:200]
                self.stopped.wait(0.05)
            finally:
                if attack is not None:
                    attack.close()
                out["rounds"] += 1
                out["bytes_sent"] += budget.sent


def attacker_main() -> None:
    parser = argparse.ArgumentParser(
        description="one attacking host, round after round", allow_abbrev=False
    )
    parser.add_argument("name", choices=sorted(ATTACKS))
    parser.add_argument("addr")
    parser.add_argument("--round-s", type=float, default=ROUND_S)
    args = parser.parse_args()
    raise_nofile(NOFILE)
    rounds = Rounds(args.name, args.addr, args.round_s)
    if rounds.spec.prepare is not None:
        rounds.spec.prepare()
    print("ready", flush=True)
    sys.stdin.readline()
    me = psutil.Process()
    cpu0, start = sum(me.cpu_times()[:2]), time.monotonic()
    worker = threading.Thread(target=rounds.run, daemon=True)
    worker.start()
    sys.stdin.readline()
    rounds.stop()
    worker.join(30)
    rounds.out["seconds"] = round(time.monotonic() - start, 2)
    rounds.out["cpu_s"] = round(sum(me.cpu_times()[:2]) - cpu0, 2)
    rounds.out["stuck"] = worker.is_alive()
    print(json.dumps(rounds.out), flush=True)


# ---- the parent's side ------------------------------------------------------------------


def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


class Attacker:
    """The attacking process, started at once, attacking between `go` and `stop`."""

    def __init__(self, name: str, addr: str, round_s: float = ROUND_S) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench._scale_attack", name, addr, "--round-s", str(round_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ready(self, timeout_s: float = 120) -> None:
        """Waits until it is prepared to attack."""
        line = _line(self.proc, timeout_s)
        if line != "ready":
            code = self.proc.poll()
            raise RuntimeError(f"the {self.name} attacker did not start: {line!r} ({code})")

    def go(self) -> None:
        self._say("go")

    def stop(self, timeout_s: float = 60) -> dict[str, Any]:
        """Stops the attack, its connections closed; its stats."""
        self._say("stop")
        line = _line(self.proc, timeout_s)
        self.proc.wait(10)
        if not line:
            raise RuntimeError(f"the {self.name} attacker said nothing when stopped")
        stats: dict[str, Any] = json.loads(line)
        return stats

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def judged_gone(
    results: list[dict[str, Any]], kills: dict[str, int], until: float
) -> dict[str, int]:
    """Healthy groups the lighthouse judged gone, as the load processes saw it:
    gone notices heard by `until` (the last step's end: at the teardown the
    load processes' streams end one process after another) naming a replica
    the bench did not kill, and answers that leave groups out at a step no
    kill explains (from a kill's step to two steps after its group came back)."""
    killed = {rid for res in results for rid in res["killed"]}
    heard = {rid for res in results for rid, at in res["gone_heard"].items() if at <= until}
    notices = heard - killed
    explained = {k + d for k in kills.values() for d in range(4)}
    short = sum(n for res in results for s, n in res["short"].items() if int(s) not in explained)
    return {"gone_notices": len(notices), "short_answers": short}


def compare(without: dict[str, Any], under: dict[str, Any]) -> dict[str, Any]:
    """One row: the run under attack beside the run without, and the criteria
    (p99 within 25%, no healthy call refused or reset, no healthy group judged
    gone) it misses."""
    p99_without, p99_with = without.get("quorum_p99_ms"), under.get("quorum_p99_ms")
    ratio = round(p99_with / p99_without, 2) if p99_without and p99_with is not None else None
    mb = under.get("attack_mb") or 0.0
    cpu_with, cpu_without = under.get("lighthouse_cpu_s"), without.get("lighthouse_cpu_s")
    per_mb = extra_per_mb = None
    if mb and cpu_with is not None:
        per_mb = float(f"{cpu_with / mb:.3g}")
        if cpu_without is not None:
            extra_per_mb = float(f"{(cpu_with - cpu_without) / mb:.3g}")
    misses = [f"failed: {under['failed']}"] if under.get("failed") else []
    if without.get("failed"):
        misses.append(f"the run without failed: {without['failed']}")
    if ratio is None or ratio > P99_SLACK:
        misses.append(f"p99 x{ratio}")
    for kind in ("refused", "reset"):
        if under.get(kind):
            misses.append(f"{under[kind]} {kind}")
    if under.get("judged_gone"):
        misses.append(f"{under['judged_gone']} judged gone")
    return {
        "attack": under.get("attack"),
        "p50_ms": f"{without.get('quorum_p50_ms')} / {under.get('quorum_p50_ms')}",
        "p99_ms": f"{p99_without} / {p99_with}",
        "p99_ratio": ratio,
        "refused": under.get("refused"),
        "reset": under.get("reset"),
        "failed": under.get("failed_calls"),
        "judged_gone": under.get("judged_gone"),
        "cores": f"{without.get('lighthouse_cores')} / {under.get('lighthouse_cores')}",
        "attack_mb": mb,
        "cpu_s_per_mb": per_mb,
        "extra_cpu_s_per_mb": extra_per_mb,
        "rss_peak_mb": f"{without.get('rss_peak_mb')} / {under.get('rss_peak_mb')}",
        "meets": not misses,
        "misses": "; ".join(misses) or "-",
    }


if __name__ == "__main__":
    attacker_main()
