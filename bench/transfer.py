"""Healing-state transfer between two processes versus raw loopback TCP, interleaved.

    python -m bench.transfer [--mb 100 1000] [--repeats 3] [--ours-chunks 1 4] [--smoke]
    python -m bench.transfer --netns [--peers 1 3] [--rate 1gbit] [--mb 1000] [--repeats 3]

For each size, one long-lived sender process per contender holds the state
of an MLP (weights, biases and AdamW moments: many tensors of realistic
sizes) and serves it; then, per repeat and in turn (A B C A B C ...), a new
receiver process fetches it twice: "fresh" (a new process, new buffers) and
"warm" (a second fetch in the same process). Contenders:

- raw: a sender sendall()s one buffer of the same size; the receiver
  recv_into()s a preallocated buffer: fresh (never touched, so every page
  faults during the receive) and reused (the same buffer again, already
  faulted in). These are the two baselines.
- ours_cN: torchft_like's HTTPTransport with num_chunks=N; ours_cN_touch
  (with --touch) prefaults by touching pages instead of madvise.
- torchft: pytorch/torchft's HTTPTransport (num_chunks=0), when importable.

Times are taken in the receiver, from the call to the last byte (or the
returned state dict), with the receiver's CPU time over the same span
(`cpu_s`, all its threads: what load from other work on the machine
inflates least). Reports medians, min/max, MB/s, and ratios of
medians to both raw baselines: `vs_fresh` divides by raw fresh (the honest
baseline for a fresh receiver), `vs_reused` by raw into a reused buffer.

--netns measures healing from several peers at once (striping) where the
links are real: each sender runs in its own network namespace whose link
is capped with tc (--rate, default 1gbit, on what it sends), the receiver
in another with an uncapped link, all joined by a bridge in a hub namespace
(bench._netns; root only; everything is deleted afterwards). For each
count in --peers, in turn per repeat, a fresh receiver process fetches the
state from that many senders (`recv_checkpoint` for one,
`recv_checkpoint_striped` for more); `vs_1` is the one-peer median over
this count's median, `ratio` its inverse (the target: <= 0.4 for 3 peers).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from bench._report import REPO, add_common_args, report, results_file

TIMEOUT = timedelta(seconds=120)
SECRET_ENV = "BENCH_TRANSFER_SECRET"
"""--netns: the job secret the senders and receivers share (they listen on
the test network's addresses, not 127.0.0.1)."""


# --- the state ----------------------------------------------------------------


def mlp_state(nbytes: int) -> dict[str, Any]:
    """An MLP's state dict plus its AdamW state after one step, about `nbytes`."""
    import torch

    width = 256 if nbytes < 20e6 else 1024 if nbytes < 300e6 else 2048
    per_layer = 12 * (width * width + width)  # fp32 weight + bias, and two moments
    layers = max(1, round(nbytes / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optim.step()
    for p in model.parameters():
        p.grad = None
    return {"model": model.state_dict(), "optim": optim.state_dict(), "torchft": {"step": 1}}


def state_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


# --- senders: print one line "ADDRESS nbytes", serve until stdin closes --------


def serve(kind: str, mb: float, chunks: int, host: str = "127.0.0.1") -> None:
    import torch

    state = mlp_state(int(mb * 1e6))
    nbytes = state_bytes(state)
    if kind == "raw":
        buf = torch.ones(nbytes, dtype=torch.uint8)  # faulted in, like live weights
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.2)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
    elif kind == "ours":
        from torchft_like.checkpointing import HTTPTransport

        transport = HTTPTransport(timeout=TIMEOUT, num_chunks=chunks, hostname=host,
                                  secret=os.environ.get(SECRET_ENV))  # fmt: skip
        transport.send_checkpoint([1], 1, state, TIMEOUT)
        address = transport.metadata()
    else:
        from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

        transport = TorchftHTTP(timeout=TIMEOUT, num_chunks=0)
        transport.send_checkpoint([1], 1, state, TIMEOUT)
        address = transport.metadata()
    print(address, nbytes, flush=True)
    if kind != "raw":
        sys.stdin.read()
        return
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    view = memoryview(buf.numpy()).cast("B")
    while not closed.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.sendall(view)


# --- receivers: two fetches, print JSON [fresh_s, warm_s] ----------------------


def receive(kind: str, address: str, nbytes: int, chunks: int, touch: bool) -> None:
    import torch

    times, cpu = [], []
    if kind == "raw":
        host, port = address.rsplit(":", 1)
        buf = None
        for _ in range(2):
            start, start_cpu = time.perf_counter(), time.process_time()
            if buf is None:  # fresh: never touched; then reused
                buf = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy()).cast("B")
            with socket.create_connection((host, int(port))) as conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if not n:
                        raise ConnectionError(f"raw stream ended after {got} of {nbytes} bytes")
                    got += n
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    else:
        if kind == "ours":
            from torchft_like.checkpointing import HTTPTransport, http_fetch

            http_fetch.Prefaulter.use_madvise = not touch
            transport = HTTPTransport(timeout=TIMEOUT, num_chunks=chunks, hostname="127.0.0.1")
        else:
            from torchft.checkpointing.http_transport import HTTPTransport as TorchftHTTP

            transport = TorchftHTTP(timeout=TIMEOUT, num_chunks=0)
        for _ in range(2):
            start, start_cpu = time.perf_counter(), time.process_time()
            state = transport.recv_checkpoint(0, address, 1, TIMEOUT)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            got = state_bytes(state)
            if got != nbytes:
                raise RuntimeError(f"{kind} received {got} bytes, want {nbytes}")
            del state
        transport.shutdown()
    print(json.dumps([times, cpu]), flush=True)


# --- --netns: healing from 1 or more peers over rate-limited links --------------


def receive_peers(
    addresses: list[str], nbytes: int, chunks: int, host: str, allow_failures: bool = False
) -> None:
    """One fetch in a fresh process, from one peer or striped across several;
    prints START when it begins, then JSON [[wall_s], [cpu_s], bytes per
    source, sources dropped]. `allow_failures`: a source may fail (it is
    killed on purpose)."""
    from torchft_like.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=TIMEOUT, num_chunks=chunks, hostname=host,
                              secret=os.environ.get(SECRET_ENV))  # fmt: skip
    print("START", flush=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    dropped: list[str] = []
    if len(addresses) == 1:
        state = transport.recv_checkpoint(0, addresses[0], 1, TIMEOUT)
        shares = [nbytes]
    else:
        sources = list(enumerate(addresses))
        state = transport.recv_checkpoint_striped(sources, 1, TIMEOUT)
        report = transport.last_stripe_report
        assert report is not None
        if report.errors and not allow_failures:
            raise RuntimeError(f"a source failed during the benchmark: {report.summary()}")
        shares, dropped = report.bytes_by_source, list(report.errors)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    got = state_bytes(state)
    if got != nbytes:
        raise RuntimeError(f"received {got} bytes, want {nbytes}")
    transport.shutdown()
    print(json.dumps([[wall], [cpu], shares, dropped]), flush=True)


def run_netns(
    mb: float, peers: list[int], repeats: int, rate: str, chunks: int, kill_after: float | None
) -> list[dict]:
    from bench import _netns

    names = [f"p{i}" for i in range(max(peers))]
    hosts: dict[str, str | None] = {name: rate for name in names}
    hosts["rx"] = None  # the receiver's link is not the bottleneck
    env = {**os.environ, "OMP_NUM_THREADS": "1", SECRET_ENV: secrets.token_hex(32)}
    rows = []
    with _netns.Network(hosts) as net:
        senders = {}
        try:
            for name in names:
                senders[name] = subprocess.Popen(
                    [*net.exec(name), sys.executable, "-m", "bench.transfer", "--serve", "ours",
                     "--mb", str(mb), "--chunks", str(chunks), "--host", net.address[name]],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
                )  # fmt: skip
            addresses, sizes = [], set()
            for name, proc in senders.items():
                line = proc.stdout.readline().split()  # type: ignore[union-attr]
                if len(line) != 2:
                    raise RuntimeError(f"sender {name} failed to start")
                addresses.append(line[0])
                sizes.add(int(line[1]))
            assert len(sizes) == 1, f"senders hold different sizes: {sizes}"
            nbytes = sizes.pop()
            times: dict[int, list[float]] = {n: [] for n in peers}
            cpus: dict[int, list[float]] = {n: [] for n in peers}
            shares: dict[int, list[int]] = {}

            def fetch(n: int, kill: str | None = None) -> tuple[list, list, list, list]:
                args = ["--allow-failures"] if kill else []
                proc = subprocess.Popen(
                    [*net.exec("rx"), sys.executable, "-m", "bench.transfer", "--recv-peers",
                     *addresses[:n], "--nbytes", str(nbytes), "--chunks", str(chunks),
                     "--host", net.address["rx"], *args],
                    stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
                )  # fmt: skip
                if kill is not None and kill_after is not None:
                    while (line := proc.stdout.readline()) and line.strip() != "START":  # type: ignore[union-attr]
                        pass
                    time.sleep(kill_after)
                    senders[kill].kill()  # SIGKILL mid-transfer: its sockets are reset
                out, _ = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"receiver from {n} peers failed ({proc.returncode})")
                result = json.loads(out.strip().splitlines()[-1])
                print(f"  {n} peer(s){f', {kill} killed' if kill else ''}: {result[0][0]:.2f} s",
                      flush=True)  # fmt: skip
                return result

            for _ in range(repeats):
                for n in peers:  # interleaved: 1 3 1 3 ...
                    wall, cpu, shares[n], _ = fetch(n)
                    times[n] += wall
                    cpus[n] += cpu
            killed = None
            if kill_after is not None and len(names) > 1:  # last: the sender does not come back
                killed = names[-1], fetch(len(names), kill=names[-1])
        finally:
            stop_senders(senders.values())
    one = statistics.median(times[peers[0]])
    for n in peers:
        med = statistics.median(times[n])
        rows.append({
            "mb": round(nbytes / 1e6), "rate": rate, "peers": n, "median_s": round(med, 3),
            "min_s": round(min(times[n]), 3), "max_s": round(max(times[n]), 3),
            "mb_per_s": round(nbytes / 1e6 / med), "ratio": round(med / one, 3),
            "vs_1": round(one / med, 2), "cpu_s": round(statistics.median(cpus[n]), 3),
            "mb_by_peer": "/".join(str(round(b / 1e6)) for b in shares[n]), "n": len(times[n]),
        })  # fmt: skip
    if killed is not None:
        name, (wall, cpu, share, dropped) = killed
        rows.append({
            "mb": round(nbytes / 1e6), "rate": rate,
            "peers": f"{len(names)}, {name} killed at {kill_after:g} s",
            "median_s": round(wall[0], 3), "min_s": round(wall[0], 3), "max_s": round(wall[0], 3),
            "mb_per_s": round(nbytes / 1e6 / wall[0]), "ratio": round(wall[0] / one, 3),
            "vs_1": round(one / wall[0], 2), "cpu_s": round(cpu[0], 3),
            "mb_by_peer": "/".join(str(round(b / 1e6)) for b in share), "n": 1,
        })  # fmt: skip
        if not dropped:
            print(f"note: {name} was killed after the fetch had ended; use a smaller --kill-after")
    return rows


# --- the driver ---------------------------------------------------------------


def worker(args: list[str]) -> subprocess.Popen:
    quiet = "torchft" in args  # its server logs every request to stderr
    return subprocess.Popen(
        [sys.executable, "-m", "bench.transfer", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        stderr=subprocess.DEVNULL if quiet else None,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def stop_senders(senders: Iterable[subprocess.Popen]) -> None:
    """Closes each sender's stdin (its signal to stop), then waits for it,
    killing one that has not stopped within 30 s."""
    senders = list(senders)
    for proc in senders:
        proc.stdin.close()  # type: ignore[union-attr]
    for proc in senders:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def torchft_importable() -> bool:
    try:
        import torchft.checkpointing.http_transport  # noqa: F401
    except Exception:
        return False
    return True


Contender = tuple[str, str, int, bool]
"""(name, kind, num_chunks, touch)"""


def run_size(mb: float, repeats: int, contenders: list[Contender]) -> list[dict]:
    senders = {name: worker(["--serve", kind, "--mb", str(mb), "--chunks", str(c)])
               for name, kind, c, _ in contenders}  # fmt: skip
    try:
        addresses = {}
        for name, proc in senders.items():
            line = proc.stdout.readline().split()
            if len(line) != 2:
                raise RuntimeError(f"sender {name} failed to start")
            addresses[name] = (line[0], int(line[1]))
        sizes = {nbytes for _, nbytes in addresses.values()}
        assert len(sizes) == 1, f"contenders hold different sizes: {sizes}"
        times: dict[str, list[list[list[float]]]] = {name: [] for name in senders}
        for _ in range(repeats):
            for name, kind, chunks, touch in contenders:  # interleaved: A B C A B C
                address, nbytes = addresses[name]
                proc = worker(["--recv", kind, "--address", address, "--nbytes", str(nbytes),
                               "--chunks", str(chunks)] + ["--touch"] * touch)  # fmt: skip
                out, _ = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"receiver {name} failed ({proc.returncode})")
                times[name].append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop_senders(senders.values())
    nbytes = next(iter(sizes))
    series, cpus = {}, {}
    for name, runs in times.items():
        second = "reused" if name == "raw" else "warm"
        for i, label in enumerate([f"{name}_fresh", f"{name}_{second}"]):
            series[label] = [wall[i] for wall, _ in runs]
            cpus[label] = [cpu[i] for _, cpu in runs]
    fresh, reused = statistics.median(series["raw_fresh"]), statistics.median(series["raw_reused"])
    rows = []
    for name, values in series.items():
        med = statistics.median(values)
        rows.append({
            "mb": round(nbytes / 1e6), "contender": name, "median_s": round(med, 3),
            "min_s": round(min(values), 3), "max_s": round(max(values), 3),
            "mb_per_s": round(nbytes / 1e6 / med), "vs_fresh": round(fresh / med, 2),
            "vs_reused": round(reused / med, 2), "cpu_s": round(statistics.median(cpus[name]), 3),
            "n": len(values),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--mb", type=float, nargs="+", default=[100, 1000],
                        help="state sizes in MB (default 100 1000)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ours-chunks", type=int, nargs="+", default=[1],
                        help="num_chunks of each contender of ours (default 1)")  # fmt: skip
    parser.add_argument("--no-torchft", action="store_true", help="skip pytorch/torchft")
    parser.add_argument("--touch", action="store_true",
                        help="also run ours touching pages, not madvise")  # fmt: skip
    add_common_args(parser)  # --smoke: 4 MB, 1 repeat, a few seconds
    parser.add_argument("--serve", choices=["raw", "ours", "torchft"], help=argparse.SUPPRESS)
    parser.add_argument("--recv", choices=["raw", "ours", "torchft"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--netns", action="store_true",
                        help="healing from --peers senders over tc-limited links in network "
                        "namespaces (root only)")  # fmt: skip
    parser.add_argument("--peers", type=int, nargs="+", default=[1, 3],
                        help="--netns: numbers of senders to fetch from (default 1 3)")  # fmt: skip
    parser.add_argument("--rate", default="1gbit",
                        help="--netns: each sender's link rate (default 1gbit)")  # fmt: skip
    parser.add_argument("--chunks", type=int, default=1,
                        help="--netns: connections per sender (default 1)")  # fmt: skip
    parser.add_argument("--kill-after", type=float, default=None,
                        help="--netns: then one more fetch from all peers, SIGKILLing the last "
                        "sender this many seconds into it (the fallback's cost)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--allow-failures", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recv-peers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.mb[0], args.chunks, args.host)
    if args.recv:
        return receive(args.recv, args.address, args.nbytes, args.chunks, args.touch)
    if args.recv_peers:
        return receive_peers(
            args.recv_peers, args.nbytes, args.chunks, args.host, args.allow_failures
        )
    if args.netns:
        return main_netns(args)
    if args.smoke:
        args.mb, args.repeats = [4], 1
    contenders: list[Contender] = [("raw", "raw", 0, False)]
    for c in args.ours_chunks:
        contenders.append((f"ours_c{c}", "ours", c, False))
        if args.touch:
            contenders.append((f"ours_c{c}_touch", "ours", c, True))
    if not args.no_torchft and torchft_importable():
        contenders.append(("torchft", "torchft", 0, False))
    rows = []
    for mb in args.mb:
        rows += run_size(mb, args.repeats, contenders)
    report(rows, results_file(args.out, "transfer"))


def main_netns(args: argparse.Namespace) -> None:
    from bench import _netns

    try:
        _netns.check_available()
    except _netns.NetnsUnavailable as e:
        sys.exit(f"bench.transfer --netns: {e}")
    if args.smoke:
        args.mb, args.repeats, args.rate = [50], 1, "200mbit"
    mbs = [1000.0] if args.mb == [100, 1000] else args.mb  # the default: 1 GB
    if sorted(set(args.peers)) != args.peers or args.peers[0] < 1:
        sys.exit("bench.transfer --netns: --peers must be increasing counts >= 1, e.g. 1 3")
    rows = []
    for mb in mbs:
        rows += run_netns(mb, args.peers, args.repeats, args.rate, args.chunks, args.kill_after)
    report(rows, results_file(args.out, "transfer_peers"))


if __name__ == "__main__":
    main()
