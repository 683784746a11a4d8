"""The Manager's configuration: every argument and environment variable it reads, resolved once.

`resolve_config` is the one place that turns the Manager's arguments and the
process environment into a frozen `ManagerConfig`, so that a user mistake
(a port that is not a number, a rank outside its group, a missing torchrun
variable) fails at once with one line naming the argument or variable and
what to set, not later in a socket or a timer. It is a function of its
arguments only, except that it reads the files TORCHFT_SECRET_FILE and
TORCHFT_TLS_* name (the secret and the TLS checks need their contents).

Precedence: argument > variable > default, except the TORCHFT_*_SEC
timeouts and TORCHFT_QUORUM_RETRIES, which win over arguments so that an
operator can change them without touching code (as in torchft).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

from lighthouse.client import LIGHTHOUSE_ENV, lighthouse_target
from lighthouse.core.jobs import DEFAULT_JOB, JOB_ENV, job_id_refusal
from lighthouse.rpc.address import BIND_HOST_ENV, HOSTNAME_ENV
from lighthouse.rpc.auth import secret_from_env
from lighthouse.rpc.tls import TLSConfig, tls_from_env
from torchft_like.manager.heal_plan import heal_sources_from_env
from torchft_like.manager.metrics import metrics_port_from_env

MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
FINGERPRINT_INTERVAL_ENV = "TORCHFT_LIKE_FINGERPRINT_INTERVAL"
"""For jobs whose Manager a framework builds (torchtitan, Ray Train)."""
CONTROL_SCHED_ENV = "TORCHFT_LIKE_CONTROL_SCHED"
CONTROL_SCHEDS = ("batch", "normal")
# torchrun's variables (not ours, so no TORCHFT_ prefix).
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


class WorldSizeMode(Enum):
    """How many replicas a step averages over.

    DYNAMIC: every up-to-date replica of the quorum.
    FIXED_WITH_SPARES: exactly `min_replica_size`; extra replicas are spares
    that contribute zeros and are not counted, so the effective batch size
    never changes.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class ManagerConfigError(ValueError):
    """A Manager argument or environment variable is invalid; the one-line
    text names it, says the rule, and what to set instead."""


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Everything a Manager was configured with, after arguments, environment
    and defaults are resolved (`resolve_config`)."""

    min_replica_size: int = 1
    """Fewest replicas a step may commit with."""
    use_async_quorum: bool = True
    """Overlap the quorum with the forward pass. When False, a failed quorum
    raises from start_quorum and a failed vote from should_commit (a timeout
    as TimeoutError), as in torchft; when True they are recorded and the
    step is skipped."""
    timeout: timedelta = timedelta(seconds=60)
    """Bound on collectives, votes and state transfers (TORCHFT_TIMEOUT_SEC)."""
    quorum_timeout: timedelta = timedelta(seconds=60)
    """Bound on one quorum (TORCHFT_QUORUM_TIMEOUT_SEC)."""
    connect_timeout: timedelta = timedelta(seconds=60)
    """Bound on reaching the lighthouse, the store and the servers (TORCHFT_CONNECT_TIMEOUT_SEC)."""
    rank: int = 0
    """This rank in its replica group (RANK)."""
    world_size: int = 1
    """Ranks in the replica group (WORLD_SIZE)."""
    world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC
    """How many replicas a step averages over."""
    store_addr: str = "127.0.0.1"
    """Host of the group's TCPStore (MASTER_ADDR)."""
    store_port: int
    """Port of the group's TCPStore (MASTER_PORT); no default: torchrun sets it."""
    store_prefix: str = "torchft/0/"
    """Key prefix in the store, one per torchrun restart (TORCHELASTIC_RESTART_COUNT),
    so that ranks never read a dead incarnation's address."""
    lighthouse_addr: str | None = None
    """URL of the lighthouse (TORCHFT_LIGHTHOUSE); required on group rank 0 only."""
    replica_id: str = "replica"
    """Name of the replica group; a uuid is appended per start."""
    port: int = 0
    """ManagerServer port on group rank 0, 0 for any free one (TORCHFT_MANAGER_PORT)."""
    hostname: str
    """How peers on other machines reach this rank: the address the
    ManagerServer and the checkpoint server advertise (and listen on, unless
    `bind_host`). TORCHFT_HOSTNAME, else this machine's name; give an address
    where the name does not resolve to one peers can reach."""
    bind_host: str | None = None
    """Host the servers listen on instead of `hostname`, e.g. 0.0.0.0 or ::
    for all interfaces (TORCHFT_BIND_HOST)."""
    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    """Between two heartbeats of rank 0 to the lighthouse."""
    init_sync: bool = True
    """At step 0 every replica copies the primary's weights."""
    max_retries: int | None = None
    """Raise after this many consecutive uncommitted steps; None: never."""
    quorum_retries: int = 0
    """Lighthouse quorum failures retried by the server (TORCHFT_QUORUM_RETRIES)."""
    fingerprint_interval: int | None = None
    """Every this many committed steps, compare a fingerprint of the state
    across replicas; a replica whose state differs from the others' at the
    same step is logged (ERROR) and heals from one that agrees (rule:
    lighthouse.core.views.find_divergence). None: off."""
    secret: str | None = None
    """The job's shared secret (lighthouse.rpc.auth), sent with every call and
    required by our servers (TORCHFT_SECRET_FILE or TORCHFT_SECRET). None:
    access control off."""
    tls: TLSConfig | None = None
    """TLS for every connection this Manager opens or serves: the
    ManagerServer, the checkpoint server, the lighthouse (lighthouse.rpc.tls;
    TORCHFT_TLS_CERT, _KEY, _CA, _CLIENT_AUTH). Peers' addresses are then
    https://. None: plaintext."""
    exit_with_parent: bool = True
    """End this process within about 0.1 s of its parent (torchrun) dying, so
    that `kill -9` of torchrun is a group death rather than an orphan that
    trains on (torchft_like.manager.parent_watch)."""
    metrics_port: int | None = None
    """Serve this rank's Prometheus metrics at http://{host}:{port}/metrics,
    0 for a free port (logged). TORCHFT_METRICS_PORT's N serves local rank r
    on N + r (torchft_like.manager.metrics). None: off; `Manager.metrics` holds them
    either way."""
    heal_sources: int | None = None
    """At most this many up-to-date peers a healing rank fetches its state
    from at once, a distinct byte range from each (striped healing,
    `HTTPTransport.recv_checkpoint_striped`), so that no one sender's link
    bounds the heal; a peer that fails mid-transfer leaves its ranges to the
    others. TORCHFT_HEAL_SOURCES (unset or "all": None, every up-to-date
    peer); 1: one peer, as torchft. A transport that cannot stripe (e.g.
    PGTransport) always uses one. A striped heal's collectives wait for the
    whole transfer (a one-peer heal's only for its start)."""
    job_id: str = DEFAULT_JOB
    """The job on the lighthouse (lighthouse.core.jobs): one lighthouse may
    serve many jobs, each apart from the others. TORCHFT_JOB_ID; the default
    is `default`, the job of every pytorch/torchft group."""
    control_sched: str = "batch"
    """Linux scheduling policy of the threads that wake each step or on a
    timer (the ManagerServer's loop, the quorum thread, the freeze watch),
    TORCHFT_LIKE_CONTROL_SCHED. batch (the default): SCHED_BATCH, woken they
    wait for a free core or the next scheduler tick (4 ms here, bench.wake_latency)
    instead of preempting the training threads
    (lighthouse.loop.set_batch_policy); normal: SCHED_OTHER, as every
    thread starts."""

    def __post_init__(self) -> None:
        # resolve_config has checked all this, naming the argument or variable;
        # these guard a config built by hand.
        for name in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval"):
            if getattr(self, name) <= timedelta(0):
                raise ManagerConfigError(f"{name} ({getattr(self, name)}) must be positive")
        for name in ("store_port", "port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ManagerConfigError(f"{name} ({value}) is out of range: a port is 0-65535")
        if not 0 <= self.rank < self.world_size:
            raise ManagerConfigError(
                f"rank ({self.rank}) must be in [0, world_size) = [0, {self.world_size})"
            )
        for name, least in (("min_replica_size", 1), ("quorum_retries", 0)):
            if getattr(self, name) < least:
                raise ManagerConfigError(f"{name} ({getattr(self, name)}) must be at least {least}")
        for name in ("fingerprint_interval", "heal_sources"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ManagerConfigError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.control_sched not in CONTROL_SCHEDS:
            raise ManagerConfigError(
                f"control_sched ({self.control_sched!r}) must be one of {CONTROL_SCHEDS}"
            )


@dataclass(frozen=True)
class _Given:
    """A value as the user gave it, and where: an argument or a variable."""

    name: str
    value: object
    from_env: bool

    def __str__(self) -> str:
        return f"{self.name}={self.value!r}"

    def fix(self, what: str) -> str:
        return f"set {self.name} to {what}" if self.from_env else f"pass {self.name} as {what}"


def _given(
    argument: object, argument_name: str, env_name: str, environ: Mapping[str, str]
) -> _Given | None:
    """The argument if given, else the variable if set and not empty, else None."""
    if argument is not None:
        return _Given(argument_name, argument, from_env=False)
    text = environ.get(env_name)
    if text is None or not str(text).strip():
        return None
    return _Given(env_name, str(text).strip(), from_env=True)


def _env_first(
    argument: object, argument_name: str, env_name: str, environ: Mapping[str, str]
) -> _Given:
    """The variable if set and not empty (operators override code), else the argument."""
    from_env = _given(None, argument_name, env_name, environ)
    return from_env or _Given(argument_name, argument, from_env=False)


def _integer(given: _Given, what: str) -> int:
    value = given.value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ManagerConfigError(f"{given} is not an integer; {given.fix(what)}")
    try:
        return int(value)
    except ValueError:
        raise ManagerConfigError(f"{given} is not an integer; {given.fix(what)}") from None


def _at_least(given: _Given, least: int, what: str) -> int:
    value = _integer(given, what)
    if value < least:
        raise ManagerConfigError(f"{given} must be at least {least}; {given.fix(what)}")
    return value


def _port(given: _Given, what: str) -> int:
    value = given.value
    text = value.strip() if isinstance(value, str) else value
    if isinstance(value, bool) or not (
        isinstance(text, int) or (isinstance(text, str) and text.isdigit())
    ):
        raise ManagerConfigError(f"{given} is not a port number; {given.fix(what)}")
    port = int(text)
    if not 0 <= port <= 65535:
        raise ManagerConfigError(f"{given} is out of range: a port is 0-65535; {given.fix(what)}")
    return port


def _duration(given: _Given) -> timedelta:
    """A positive timedelta from a timedelta or a number of seconds (a
    variable's text, or an int or float argument)."""
    what = "a positive number of seconds" + ("" if given.from_env else " or a timedelta")
    value = given.value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and given.from_env:
        try:
            seconds = float(value)
        except ValueError:
            raise ManagerConfigError(
                f"{given} is not a number of seconds; {given.fix(what)}"
            ) from None
    else:
        raise ManagerConfigError(
            f"{given} is a {type(value).__name__}, not a duration; {given.fix(what)}"
        )
    if not seconds > 0 or not math.isfinite(seconds) or seconds > timedelta.max.total_seconds():
        raise ManagerConfigError(f"{given} must be a positive, finite duration; {given.fix(what)}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def _lighthouse(given: _Given | None, tls: TLSConfig | None) -> str:
    if given is None:
        raise ManagerConfigError(
            f"no lighthouse address: pass lighthouse_addr or set {LIGHTHOUSE_ENV}, "
            "e.g. http://localhost:29510"
        )
    url = str(given.value)
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme not in (None, "http", "https"):
        raise ManagerConfigError(
            f"{given}: the scheme must be http:// or https:// (https only with TLS); "
            f"{given.fix('the URL torchft-lighthouse printed at start, e.g. http://host:29510')}"
        )
    lighthouse_target(url, tls)  # the port, and https exactly when TLS: names the variable
    return url


OBJECT_ARGUMENTS = frozenset(
    ("self", "pg", "load_state_dict", "state_dict", "checkpoint_transport", "fingerprint_fn")
)
"""The Manager's arguments that are objects, not ManagerConfig fields."""


def config_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The Manager's arguments (its `locals()` on entry) that resolve_config takes."""
    return {k: v for k, v in arguments.items() if k not in OBJECT_ARGUMENTS}


def resolve_config(
    *,
    min_replica_size: int = 1,
    use_async_quorum: bool = True,
    timeout: timedelta | float = timedelta(seconds=60),
    quorum_timeout: timedelta | float = timedelta(seconds=60),
    connect_timeout: timedelta | float = timedelta(seconds=60),
    rank: int | None = None,
    world_size: int | None = None,
    world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
    store_addr: str | None = None,
    store_port: int | None = None,
    lighthouse_addr: str | None = None,
    replica_id: str | None = None,
    port: int | None = None,
    hostname: str | None = None,
    heartbeat_interval: timedelta | float = timedelta(milliseconds=100),
    init_sync: bool = True,
    max_retries: int | None = None,
    quorum_retries: int = 0,
    fingerprint_interval: int | None = None,
    secret: str | None = None,
    tls: TLSConfig | None = None,
    exit_with_parent: bool = True,
    metrics_port: int | None = None,
    heal_sources: int | None = None,
    job_id: str | None = None,
    environ: Mapping[str, str],
    machine_name: Callable[[], str] = socket.gethostname,
) -> ManagerConfig:
    """The Manager's configuration from its arguments (same names and
    meanings as `Manager`'s) and `environ` (os.environ for the Manager).

    `machine_name` is called only when neither `hostname` nor
    TORCHFT_HOSTNAME is given.

    Raises:
        ManagerConfigError: an argument or variable is invalid or missing;
            the text names it and what to set.
        ValueError: a bad secret, TLS or heal/metrics variable, or a
            lighthouse URL without a port (the checks those modules own).
    """
    if min_replica_size < 1:
        raise ManagerConfigError(f"min_replica_size ({min_replica_size}) must be at least 1")
    given_interval = _given(
        fingerprint_interval, "fingerprint_interval", FINGERPRINT_INTERVAL_ENV, environ
    )
    if given_interval is not None:
        what = "a number of committed steps, at least 1 (unset: no fingerprints)"
        fingerprint_interval = _at_least(given_interval, 1, what)
    if heal_sources is None:
        heal_sources = heal_sources_from_env(environ)
    elif heal_sources < 1:
        raise ManagerConfigError(
            f"heal_sources ({heal_sources}) must be at least 1 (1 heals from one peer), "
            "or None for every up-to-date peer"
        )
    if metrics_port is None:
        metrics_port = metrics_port_from_env(environ)
    else:
        metrics_port = _port(_Given("metrics_port", metrics_port, False), "a free port, or 0")

    durations = {
        name: _duration(_env_first(value, name, env, environ))
        for name, value, env in (
            ("timeout", timeout, TIMEOUT_SEC_ENV),
            ("quorum_timeout", quorum_timeout, QUORUM_TIMEOUT_SEC_ENV),
            ("connect_timeout", connect_timeout, CONNECT_TIMEOUT_SEC_ENV),
        )
    }
    interval = _duration(_Given("heartbeat_interval", heartbeat_interval, False))
    retries = _at_least(
        _env_first(quorum_retries, "quorum_retries", QUORUM_RETRIES_ENV, environ),
        0,
        "how many lighthouse failures a quorum retries, e.g. 0",
    )

    given_world = _given(world_size, "world_size", WORLD_SIZE_ENV, environ)
    group_size = 1 if given_world is None else _at_least(given_world, 1, "the group's size")
    given_rank = _given(rank, "rank", RANK_ENV, environ)
    group_rank = 0 if given_rank is None else _integer(given_rank, "this rank in its group")
    if not 0 <= group_rank < group_size:
        world = given_world or _Given("world_size", 1, from_env=False)
        raise ManagerConfigError(
            f"{given_rank} is not in [0, {world.name}={group_size}): a rank counts from 0 to "
            f"the group's size - 1; pass rank and world_size (or set {RANK_ENV} and "
            f"{WORLD_SIZE_ENV}, as torchrun does) for this process's place in its group"
        )

    given_store_port = _given(store_port, "store_port", MASTER_PORT_ENV, environ)
    if given_store_port is None:
        raise ManagerConfigError(
            f"{MASTER_PORT_ENV} is not set: torchrun sets {MASTER_ADDR_ENV} and "
            f"{MASTER_PORT_ENV} (the group's TCPStore); outside torchrun set both, or pass "
            "store_addr and store_port"
        )
    store = _port(given_store_port, "the port of the group's TCPStore")

    secret = secret if secret is not None else secret_from_env(environ)
    tls = tls if tls is not None else tls_from_env(environ)
    job = job_id if job_id is not None else environ.get(JOB_ENV, DEFAULT_JOB)
    why = job_id_refusal(job)
    if why is not None:
        raise ManagerConfigError(why)
    given_port = _given(port, "port", MANAGER_PORT_ENV, environ)
    server_port = 0 if given_port is None else _port(given_port, "a free port, or 0 for any")
    control_sched = environ.get(CONTROL_SCHED_ENV, "").strip().lower() or "batch"
    if control_sched not in CONTROL_SCHEDS:
        raise ManagerConfigError(
            f"{CONTROL_SCHED_ENV}={environ[CONTROL_SCHED_ENV]!r} is not a policy; set it to "
            "batch (the default: the Manager's threads never preempt training) or normal"
        )
    url = None  # only group rank 0 talks to the lighthouse
    if group_rank == 0:
        url = _lighthouse(_given(lighthouse_addr, "lighthouse_addr", LIGHTHOUSE_ENV, environ), tls)

    return ManagerConfig(
        min_replica_size=min_replica_size,
        use_async_quorum=use_async_quorum,
        timeout=durations["timeout"],
        quorum_timeout=durations["quorum_timeout"],
        connect_timeout=durations["connect_timeout"],
        rank=group_rank,
        world_size=group_size,
        world_size_mode=world_size_mode,
        store_addr=store_addr or environ.get(MASTER_ADDR_ENV) or "127.0.0.1",
        store_port=store,
        store_prefix=f"torchft/{environ.get(RESTART_COUNT_ENV, '0')}/",
        lighthouse_addr=url,
        replica_id=replica_id or "replica",
        port=server_port,
        hostname=hostname or environ.get(HOSTNAME_ENV) or machine_name(),
        bind_host=environ.get(BIND_HOST_ENV) or None,
        heartbeat_interval=interval,
        init_sync=init_sync,
        max_retries=max_retries,
        quorum_retries=retries,
        fingerprint_interval=fingerprint_interval,
        secret=secret,
        tls=tls,
        exit_with_parent=exit_with_parent,
        metrics_port=metrics_port,
        heal_sources=heal_sources,
        control_sched=control_sched,
        job_id=job,
    )
