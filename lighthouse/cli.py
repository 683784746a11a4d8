"""`torchft-lighthouse`: runs a lighthouse until interrupted."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import signal
import sys
import threading
from typing import NoReturn

from lighthouse import __version__
from lighthouse.core.jobs import check_job_id, parse_rule
from lighthouse.rpc import auth, serve, tls
from lighthouse.shell.server import LighthouseServer

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _OneLineErrorParser(argparse.ArgumentParser):
    """Says a command-line mistake in one line, as the other start-up errors do,
    not under a 13-line usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrorParser(
        allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
        prog="torchft-lighthouse",
        description="Coordinator of torchft_like replica groups: forms a quorum each step.",
        epilog=f"""\
environment:
  {auth.SECRET_FILE_ENV}   file holding the job's shared secret (same as --secret-file)
  {auth.SECRET_ENV}        the secret itself, when no file is given
  Without either, access control is off: a lighthouse listening off loopback
  then logs a SECURITY warning. Replicas find the lighthouse through
  TORCHFT_LIGHTHOUSE=http://HOST:PORT (the port is required).
  {tls.CERT_ENV} / {tls.KEY_ENV} / {tls.CA_ENV}
                       PEM files, as --tls-cert / --tls-key / --tls-ca
  {tls.CLIENT_AUTH_ENV}=1   as --tls-client-auth
  With TLS, replicas use TORCHFT_LIGHTHOUSE=https://HOST:PORT and the same variables.

example:
  {auth.SECRET_FILE_ENV}=/etc/torchft/secret torchft-lighthouse --min-replicas 2 \\
      --bind 10.0.0.5:29510 --http-bind 127.0.0.1:29511 \\
      --state-file /var/lib/torchft/lighthouse.json
""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # torchft's underscore spellings are accepted too, so its scripts run unchanged.
    p.add_argument(
        "--bind",
        default="[::]:29510",
        help="gRPC address to listen on, host:port (default [::]:29510; port 0 picks a free one)",
    )
    p.add_argument(
        "--min-replicas",
        "--min_replicas",
        dest="min_replicas",
        type=int,
        required=True,
        help="fewest replica groups a new quorum may have (>= 1, required)",
    )
    p.add_argument(
        "--join-timeout-ms",
        "--join_timeout_ms",
        dest="join_timeout_ms",
        type=int,
        default=60000,
        help="ms a valid quorum waits for healthy stragglers after the first join (default 60000)",
    )
    p.add_argument(
        "--quorum-tick-ms",
        "--quorum_tick_ms",
        dest="quorum_tick_ms",
        type=int,
        default=100,
        help="ms between re-runs of the quorum decision (default 100)",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        "--heartbeat_timeout_ms",
        dest="heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="ms of silence after which a replica is unhealthy (default 5000)",
    )
    p.add_argument(
        "--suspect-phi",
        type=float,
        default=8.0,
        help="suspicion (phi accrual over each replica's heartbeat rhythm) above which a "
        "silent replica is taken as hung and left out of the next quorum before the "
        "heartbeat timeout (default 8; 0: off)",
    )
    p.add_argument(
        "--suspect-min-ms",
        type=int,
        default=700,
        help="ms of silence below which no replica is suspected, whatever its rhythm (default 700)",
    )
    p.add_argument(
        "--http-bind",
        "--http_bind",
        dest="http_bind",
        default="[::]:29511",
        help="status page and /metrics address, host:port (default [::]:29511; empty: off)",
    )
    p.add_argument(
        "--secret-file",
        "--secret_file",
        dest="secret_file",
        default=None,
        help=f"file holding the job's shared secret; every call must then carry it "
        f"(default: ${auth.SECRET_FILE_ENV}, else ${auth.SECRET_ENV}, else no access control)",
    )
    p.add_argument(
        "--state-file",
        default=None,
        metavar="PATH",
        help="keep the job's high-water mark (its highest committed step) and last quorum in "
        "this JSON file, replaced atomically, and read it at start: a restarted lighthouse then "
        "refuses to let groups at step 0 start the job over and issues its first quorum as "
        "soon as the last one's members are back (default: none, kept in memory only)",
    )
    p.add_argument(
        "--allow-fresh-start",
        action="store_true",
        help="let replica groups that are all at step 0 train from fresh weights although the "
        "job already committed steps; without it they wait, and are told why, until a group "
        "that holds the job's state (or a durable checkpoint) is back (default off)",
    )
    p.add_argument(
        "--kill-button",
        action="store_true",
        help="put a kill form on the status page: POST /kill sends Kill to a replica group's "
        "ManagerServer once the operator types the job's secret (needs a secret; default off)",
    )
    p.add_argument(
        "--job-secrets",
        nargs="+",
        default=[],
        metavar="JOB=FILE",
        help="jobs with a secret of their own, each JOB=FILE (a file holding it): that job's "
        "calls must carry it, it is refused in every other job, and the job's status pages "
        "need it (a job not listed takes --secret-file's, if any; default: none)",
    )
    p.add_argument(
        "--job-rule",
        action="append",
        default=[],
        metavar="JOB.OPTION=VALUE",
        help="one job's own min_replicas or join_timeout_ms, e.g. train-7.min_replicas=4; "
        "repeat it for more (default: every job has the lighthouse's)",
    )
    p.add_argument(
        "--max-jobs",
        type=int,
        default=1000,
        help="most jobs held at once; a call naming a new job past it is refused "
        "(RESOURCE_EXHAUSTED) until one is forgotten (default 1000)",
    )
    p.add_argument(
        "--max-members-per-job",
        type=int,
        default=20_000,
        help="most replicas one job may have; a new one past it is refused (default 20000)",
    )
    p.add_argument(
        "--max-members",
        type=int,
        default=100_000,
        help="most replicas all jobs together may have; a new one past it is refused "
        "(default 100000)",
    )
    p.add_argument(
        "--job-idle-s",
        type=float,
        default=3600.0,
        help="a job with no replica, call or stream left is forgotten after this many seconds, "
        "its state file with it; never the default job (default 3600)",
    )
    # Defined only to refuse it with the reason: a secret on the command line
    # is readable by every user; "unrecognized argument" would not say so.
    p.add_argument("--secret", action=_RefuseSecretValue, help=argparse.SUPPRESS)
    p.add_argument(
        "--tls-cert",
        default=None,
        help=f"PEM certificate (valid for the host replicas connect to) to serve TLS with; "
        f"needs --tls-key (default: ${tls.CERT_ENV}, else plaintext)",
    )
    p.add_argument(
        "--tls-key",
        default=None,
        help=f"PEM private key of --tls-cert (default: ${tls.KEY_ENV})",
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        help=f"PEM CA that client certificates must chain to (default: ${tls.CA_ENV})",
    )
    p.add_argument(
        "--tls-client-auth",
        action="store_true",
        default=None,
        help=f"require a client certificate signed by --tls-ca from every caller "
        f"(mutual TLS; default: ${tls.CLIENT_AUTH_ENV}=1, else off)",
    )
    p.add_argument(
        "--rpc-server",
        default="lean",
        choices=serve.RPC_SERVERS,
        help="what serves the gRPC port, on the same wire: lean (our asyncio HTTP/2 server, a "
        "fraction of grpcio's CPU per call) or grpcio (grpc's own asyncio server) (default lean)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level, any case: " + ", ".join(LOG_LEVELS) + " (default INFO)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


class _RefuseSecretValue(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        parser.error(
            "refusing --secret: a secret on the command line can be read by every user of "
            f"this machine (ps, shell history); put it in a file and pass --secret-file, or "
            f"set {auth.SECRET_FILE_ENV} or {auth.SECRET_ENV}"
        )


GC_THRESHOLDS = (1_000_000, 20, 20)
"""The collector's thresholds in a lighthouse process (Python's: 700, 10, 10)."""


def tune_gc() -> None:
    """A lighthouse's heap is mostly the job's state, thousands of long-lived
    objects per thousand groups, and each step allocates a burst of short-lived
    ones: with Python's thresholds the collector runs every ~25 Quorum calls
    and walks the whole heap twice a step at 10,000 groups (a third of a
    call's cost, bench/NOTES.md). What exists at start is frozen out of
    every collection; the young generations are collected once a quorum's
    answers are out (LighthouseServer's collect_after_issue), the quiet moment
    before the next step's burst, and seldom within one. Only the standalone
    process does this: a LighthouseServer inside a training process leaves
    that process's collector alone."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def raise_nofile() -> int:
    """Lifts the process's soft descriptor limit to its hard one, as Go's
    runtime does: each replica group holds a connection, and the server's
    connection cap follows the soft limit (1,024 by default on Linux).
    Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # a limit the platform will not take: the cap follows the soft one
    return soft


def parse_job_secrets(items: list[str]) -> dict[str, str]:
    """`--job-secrets JOB=FILE ...` as job -> secret (each file read).

    Raises:
        ValueError: an item not JOB=FILE, a bad job id, a job twice, a bad file.
    """
    secrets: dict[str, str] = {}
    for item in items:
        job, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--job-secrets {item!r} is not JOB=FILE, e.g. train-7=/etc/t7.secret")
        check_job_id(job)
        if job in secrets:
            raise ValueError(f"--job-secrets names job {job!r} twice; give each job one file")
        secrets[job] = auth.read_secret_file(path)
    return secrets


def parse_job_rules(items: list[str]) -> dict[str, dict[str, int]]:
    """`--job-rule JOB.OPTION=VALUE` (repeated) as job -> {option: value}.
    Raises ValueError (lighthouse.core.jobs.parse_rule)."""
    rules: dict[str, dict[str, int]] = {}
    for item in items:
        job, option, value = parse_rule(item)
        rules.setdefault(job, {})[option] = value
    return rules


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_nofile()
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        secret = auth.load_secret(args.secret_file)
        tls_config = tls.tls_from_env(
            os.environ, args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth
        )
        if tls_config is not None:
            tls_config.require_server("lighthouse")
        job_secrets = parse_job_secrets(args.job_secrets)
        if args.kill_button and secret is None and not job_secrets:
            raise ValueError(
                f"--kill-button needs the job's secret: set {auth.SECRET_FILE_ENV} (or pass "
                "--secret-file, or --job-secrets) to a file holding it; without one no kill "
                "can be checked"
            )
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            suspect_phi=args.suspect_phi,
            suspect_min_ms=args.suspect_min_ms,
            http_bind=args.http_bind or None,
            secret=secret,
            tls=tls_config,
            kill_button=args.kill_button,
            state_file=args.state_file,
            allow_fresh_start=args.allow_fresh_start,
            rpc_server=args.rpc_server,
            collect_after_issue=True,
            job_secrets=job_secrets,
            job_rules=parse_job_rules(args.job_rule),
            max_jobs=args.max_jobs,
            max_members_per_job=args.max_members_per_job,
            max_members=args.max_members,
            job_idle_s=args.job_idle_s,
        )
    except (ValueError, OSError) as e:
        print(f"torchft-lighthouse: error: {e}", file=sys.stderr)
        return 2
    tune_gc()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("shutting down")
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
