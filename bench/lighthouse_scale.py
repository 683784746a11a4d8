"""One lighthouse process for thousands of replica groups, measured.

    python -m bench.lighthouse_scale --groups N --step-s S --json PATH
        [--servers ours ref] [--steps 8] [--procs 2] [--groups-per-connection 40]
    python -m bench.lighthouse_scale --groups 1000 --step-s 1 --json PATH
        --attack NAME [NAME ...] | all  [--attack-round-s 3]

A real lighthouse process (ours, `python -m lighthouse`, and beside it
pytorch/torchft's Rust one, .venv/bin/torchft_lighthouse) and --procs load
processes (bench/_scale_load.py) driving N simulated groups over real gRPC:
paced heartbeat streams (unary heartbeats to the Rust lighthouse, which has
no streams), one Quorum call per step at the step's boundary (ours asked for
the group's view), every step commits, and --kills groups die just before a
step (their stream is reset; silent to the Rust one) and come back two steps
later under a new id. Several groups share one HTTP/2 connection
(--groups-per-connection; a connection carries at most 100 streams, and one
connection per group would need N sockets in each process).

Per server, over the steps after --warmup: the lighthouse's CPU in cores,
quorum latency p50/p99 from the step's last call to each answer's arrival
in its load process (the lighthouse's own part: stamped when the read that
carried it began, not when the load's task for it ran; the medians of its
first answer and of the spread to its last say which of taking the calls
in or answering them costs more), the answer bytes each group receives per
step, the bytes the lighthouse sends per group and step (everything the load
processes receive in the window: HTTP/2 framing, heartbeat advice and
acknowledgements included), its RSS, the CPU it spends once every load
process has gone (all streams ending together), and the gone-detection time:
from a kill to the first survivor that learns of it (a gone notice on its
stream, or an answer without the killed group). PATH gets one JSON object
per server (the first, ours, at the top level; the others under "beside").

A healthy fleet under attack (--attack, ours only, --kills 0 unless told):
per attack of tools/h2_attacks.py (or `all` of them), two runs in a row at
the same --groups and --step-s, the first without it and the second with
one attacking host: a process of its own (bench/_scale_attack.py),
connecting from 127.0.0.2 while the load is on 127.0.0.1, that runs the
attack again and again (a fresh budget of --attack-round-s seconds each)
from the start of the measured steps to their end, and is stopped, its
connections closed, before the teardown. Each run also reports the healthy
calls that failed, by kind (refused: a refusing status, REFUSED_STREAM or
ENHANCE_YOUR_CALM; reset: the call or its connection ended by the server;
failed: anything else, such as no answer in time), counted by the load
processes without ending the run (a heartbeat stream the server ends is
counted and opened again), the healthy groups judged gone (gone notices of
replicas the bench did not kill, and answers that leave groups out at a
step no kill explains), its peak RSS, and under attack the MB the attacker
sent. A second table puts each attack's run beside the one without:
quorum p50 and p99 (without / with), their p99 ratio, refused, reset,
failed, judged gone, lighthouse cores and peak RSS (without / with), and
the lighthouse's CPU seconds over the attack per MB the attacker sent
(`cpu_s_per_mb`; `extra_cpu_s_per_mb` takes the run without's CPU off
first). `meets` says whether the run under attack met the criteria: p99
at most 1.25 times the p99 without, no healthy call refused or reset, no
healthy group judged gone (`misses` says which it did not). PATH gets
{"attacks": [those rows], "runs": [every run's row]}. On a small machine
the attacker competes with the lighthouse and the load for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench._report import REPO, add_common_args, pct, report, results_file
from bench._scale_attack import NOFILE, ROUND_S, Attacker, compare, judged_gone
from lighthouse.core.pacing import advised_interval_ms
from tools.h2_attacks import ATTACKS, MB, raise_nofile
from tools.procs import PeakRss, free_port, wait_listening

VENV_BIN = Path(sys.executable).parent
HEARTBEAT_TIMEOUT_MS = 5000


def start_server(
    server: str, n: int, min_replicas: int, port: int, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """A lighthouse on 127.0.0.1:`port`, listening; `extra`: more flags of ours."""
    timing = ["--join_timeout_ms", "60000", "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]
    if server == "null":
        args = [sys.executable, "-m", "bench._null_lighthouse", "--bind", f"127.0.0.1:{port}"]
        args += ["--groups", str(n)]
        timing = []
    elif server == "ref":
        exe = shutil.which("torchft_lighthouse", path=str(VENV_BIN))
        if exe is None:
            raise RuntimeError("no .venv/bin/torchft_lighthouse: pip install torchft-nightly")
        args = [exe, "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{port}"]
    else:
        args = [sys.executable, "-m", "lighthouse", "--min-replicas", str(min_replicas)]
        args += ["--bind", f"127.0.0.1:{port}", "--http-bind", "", "--log-level", "WARNING"]
        args += extra
    proc = subprocess.Popen(
        args + timing, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_listening(port, proc, f"the {server} lighthouse")
    except RuntimeError:
        proc.kill()
        raise
    return proc


def profile(pid: int, out: Path, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy over the lighthouse for the window, as collapsed stacks in `out`."""
    spy = shutil.which("py-spy", path=str(VENV_BIN)) or shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [spy, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200"]
    cmd += ["-f", "raw", "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_load(cfg: dict[str, Any]) -> subprocess.Popen[str]:
    """A load process (bench/_scale_load.py) of config `cfg`; it says "ready"
    once its groups are in a quorum, then steps on the line its stdin gets."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench._scale_load", json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )


def quorum_latencies(
    results: list[dict[str, Any]], steps: range
) -> tuple[list[float], list[float], list[float]]:
    """The lighthouse's own part over `steps`: from each step's last call to
    each answer's arrival; and per step, to the first answer (the calls
    taken in) and from the first answer to the last (the answers sent)."""
    latencies: list[float] = []
    first_answer: list[float] = []
    spread: list[float] = []
    for step in steps:
        rows = [tuple(r) for res in results for r in res["steps"].get(str(step), [])]
        if rows:
            last = max(sent for sent, _ in rows)
            arrived = [done for _, done in rows]
            latencies += [max(0.0, done - last) for done in arrived]
            first_answer.append(min(arrived) - last)
            spread.append(max(arrived) - min(arrived))
    return latencies, first_answer, spread


def said(proc: subprocess.Popen[str], word: str, timeout_s: float, what: str) -> None:
    """Waits for `proc` to print the line `word`, at most `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else f"nothing within {timeout_s:.0f} s"
    if line != word:
        raise RuntimeError(f"{what} did not say {word!r}: {line!r} (exit code {proc.poll()})")


def settle(lh: psutil.Process, limit_s: float = 60.0) -> float:
    """CPU seconds the lighthouse spends from now until a half second
    passes with under 5% of a core."""
    start = sum(lh.cpu_times()[:2])
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = sum(lh.cpu_times()[:2])
        time.sleep(0.5)
        if sum(lh.cpu_times()[:2]) - before < 0.025:
            break
    return sum(lh.cpu_times()[:2]) - start


def run_one(server: str, args: argparse.Namespace, attack: str | None = None) -> dict[str, Any]:
    n = args.groups
    kills = {str(g): args.warmup + 2 + i for i, g in enumerate(range(0, n, max(1, n // 2))[:2])}
    kills = dict(list(kills.items())[: args.kills if server != "null" else 0])
    port = free_port()
    lighthouse = start_server(server, n, n - len(kills), port)
    lh = psutil.Process(lighthouse.pid)
    loads: list[subprocess.Popen[str]] = []
    attacker: Attacker | None = None
    attacked: dict[str, Any] = {}
    try:
        if attack:  # its start overlaps the load's
            attacker = Attacker(attack, f"127.0.0.1:{port}", args.attack_round_s)
        procs = max(1, min(args.procs, n))
        for p in range(procs):
            gids = list(range(p, n, procs))
            cfg = {
                "target": f"127.0.0.1:{port}",
                "gids": gids,
                "groups": n,
                "groups_per_connection": args.groups_per_connection,
                "step_s": args.step_s,
                "world_size": args.world_size,
                "view": server != "ref",
                "paced": server != "ref",
                # The unary heartbeats to the Rust lighthouse come at the
                # period ours would advise, so both see the same rate.
                "heartbeat_s": advised_interval_ms(n, HEARTBEAT_TIMEOUT_MS) / 1000,
                "kills": {g: s for g, s in kills.items() if int(g) in set(gids)},
                "nice": args.nice_load,
            }
            loads.append(start_load(cfg))
        for proc in loads:  # every group connected and answered once
            said(proc, "ready", 600, f"a load process for {server} n={n}")
        if attacker is not None:
            attacker.ready()
        steps = args.warmup + args.steps
        t0 = time.time() + 1.0
        window_from = args.warmup + 1
        for proc in loads:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps([t0, steps, window_from]) + "\n")
            proc.stdin.flush()
        time.sleep(max(0.0, t0 + args.warmup * args.step_s - 0.2 - time.time()))
        cpu0, w0 = lh.cpu_times(), time.time()
        if attacker is not None:
            attacker.go()
        peak = PeakRss(lh, interval_s=0.1)
        spy = None
        if args.profile and server == "ours":
            spy = profile(lighthouse.pid, args.profile / f"ours.{n}.txt", args.steps * args.step_s)
        for proc in loads:
            said(proc, "stepped", steps * args.step_s + 240, f"a load process for {server} n={n}")
        cpu1, w1 = lh.cpu_times(), time.time()
        rss_mb = lh.memory_info().rss / 2**20
        if attacker is not None:  # closed before the teardown
            attacked = attacker.stop()
        rss_peak_mb = peak.stop() / MB
        results = []
        for proc in loads:  # every stream ends at once
            out, _ = proc.communicate("close\n", timeout=240)
            results.append(json.loads(out.strip().splitlines()[-1]))
        teardown_s = sum(lh.cpu_times()[:2]) - sum(cpu1[:2]) + settle(lh)
        if spy is not None:
            spy.wait(60)
    finally:
        if attacker is not None:
            attacker.kill()
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        lighthouse.kill()
        lighthouse.wait(10)
    latencies, first_answer, spread = quorum_latencies(results, range(window_from, steps + 1))
    killed = {rid: t for res in results for rid, t in res["killed"].items()}
    gone_s = []
    for rid, at in killed.items():
        heard = [res["gone_heard"][rid] for res in results if rid in res["gone_heard"]]
        step = kills[str(int(rid.removeprefix("group").split(":")[0]))]
        without = [res["first_without"][str(step)] for res in results]
        without = [t for t in without if t]
        learnt = min(heard + without, default=None)
        if learnt is not None:
            gone_s.append(learnt - at)
    errors = [e for res in results for e in res["errors"]]
    if errors:
        print(f"{server} n={n}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    window = w1 - w0
    window_steps = steps - window_from + 1
    answers = sum(res["answers"] for res in results)
    row = {
        "server": server,
        "groups": n,
        "step_s": args.step_s,
        "world_size": args.world_size,
        "steps": window_steps,
        "lighthouse_cores": round((sum(cpu1[:2]) - sum(cpu0[:2])) / window, 3),
        "quorum_p50_ms": round(1000 * pct(latencies, 0.5), 1),
        "quorum_p99_ms": round(1000 * pct(latencies, 0.99), 1),
        # Medians over the steps: from the last call to the first answer
        # (the calls taken in) and from the first answer to the last.
        "first_answer_ms": round(1000 * pct(first_answer, 0.5), 1),
        "answer_spread_ms": round(1000 * pct(spread, 0.5), 1),
        "answer_bytes_per_group_step": round(
            sum(res["answer_bytes"] for res in results) / max(answers, 1)
        ),
        "lighthouse_bytes_per_group_step": round(
            sum(res["received"] for res in results) / max(n * window_steps, 1)
        ),
        "rss_mb": round(rss_mb, 1),
        "teardown_cpu_s": round(teardown_s, 2),
        "gone_s": round(max(gone_s), 3) if gone_s else None,
        "heartbeats_per_s": round(sum(res["heartbeats"] for res in results) / window),
        "load_cores": round(sum(res["cpu_s"] for res in results) / window, 3),
        "nice_load": args.nice_load,
        "errors": len(errors),
    }
    if args.attack:
        failures = {kind: 0 for kind in ("refused", "reset", "failed")}
        for res in results:
            for by_kind in res["failures"].values():
                for kind, count in by_kind.items():
                    failures[kind] += count
        gone = judged_gone(results, kills, until=w1)
        mb = attacked.get("bytes_sent", 0) / MB
        row.update(
            attack=attack,
            lighthouse_cpu_s=round(sum(cpu1[:2]) - sum(cpu0[:2]), 2),
            rss_peak_mb=round(rss_peak_mb, 1),
            refused=failures["refused"],
            reset=failures["reset"],
            failed_calls=failures["failed"],
            judged_gone=sum(gone.values()),
            **gone,
            attack_mb=round(mb, 2),
            attack_rounds=attacked.get("rounds"),
            attack_errors=attacked.get("errors"),
            attacker_cores=round(attacked["cpu_s"] / window, 3) if attacked else None,
            attack_notes=attacked.get("notes"),
            attack_endings=attacked.get("endings"),
        )
        if attacked.get("first_error"):
            print(f"{attack}: the attacker's first error: {attacked['first_error']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="where to write the results")
    parser.add_argument(
        "--servers",
        nargs="+",
        default=None,
        choices=["ours", "ref", "null"],
        help="ours, pytorch/torchft's Rust one (ref), and null: the lean gRPC server with "
        "handlers that do nothing (bench/_null_lighthouse.py), the floor under ours "
        "(default ours ref; ours alone with --attack)",
    )
    parser.add_argument(
        "--attack",
        nargs="+",
        choices=[*ATTACKS, "all"],
        metavar="NAME",
        help="per named attack of tools/h2_attacks.py (or all): a run of ours without it, "
        "then one with an attacking host during the measured steps",
    )
    parser.add_argument(
        "--attack-round-s",
        type=float,
        default=ROUND_S,
        help=f"seconds of each round of the attack, a fresh budget each (default {ROUND_S:g})",
    )
    parser.add_argument("--steps", type=int, default=8, help="measured steps (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before (default 2)")
    parser.add_argument("--procs", type=int, default=2, help="load processes (default 2)")
    parser.add_argument("--groups-per-connection", type=int, default=40)
    parser.add_argument("--world-size", type=int, default=8, help="ranks per group (default 8)")
    parser.add_argument(
        "--kills", type=int, help="groups killed (default 2; 0 with --attack: none judged gone)"
    )
    parser.add_argument("--profile", type=Path, help="py-spy our lighthouse into this folder")
    parser.add_argument(
        "--nice-load",
        action="store_true",
        help="run the load processes at nice 19: on one small box they then stand for other "
        "machines instead of taking the lighthouse's core at each step's burst",
    )
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.step_s, args.steps, args.warmup = 20, 0.5, 4, 1
    if args.kills is None:
        args.kills = 0 if args.attack else 2
    if args.attack:
        if args.servers not in (None, ["ours"]):
            parser.error("--attack measures ours alone: leave out --servers")
        attacks(args)
        return
    args.servers = args.servers or ["ours", "ref"]
    rows = []
    for server in args.servers:
        try:
            rows.append(run_one(server, args))
        except RuntimeError as e:  # the Rust lighthouse at 10,000 groups
            print(f"{server} n={args.groups} could not be measured: {e}", file=sys.stderr)
            failed = {k: None for k in rows[0]} if rows else {}
            rows.append({**failed, "server": server, "groups": args.groups, "failed": str(e)})
    report(rows, results_file(args.out, "lighthouse_scale"))
    if args.json:
        top = dict(rows[0])
        top["beside"] = rows[1:]
        args.json.write_text(json.dumps(top, indent=1) + "\n")


def attacks(args: argparse.Namespace) -> None:
    """Per attack, a run without it and then one with it, side by side."""
    raise_nofile(NOFILE)  # before the lighthouse starts: it inherits it
    names = list(ATTACKS) if "all" in args.attack else list(dict.fromkeys(args.attack))
    runs, rows = [], []
    for name in names:
        pair = []
        for attack in (None, name):
            try:
                pair.append(run_one("ours", args, attack))
            except RuntimeError as e:
                print(f"{attack or 'no attack'} could not be measured: {e}", file=sys.stderr)
                pair.append({"server": "ours", "attack": attack, "failed": str(e)})
        runs += pair
        rows.append(compare(*pair))
    report(runs, results_file(args.out, "lighthouse_scale"))
    print()
    report(rows, results_file(args.out, "lighthouse_scale_attack"))
    if args.json:
        args.json.write_text(json.dumps({"attacks": rows, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
