"""A discrete-event simulation of a fleet of replica groups around the
lighthouse's real membership state machine (bench.fleet_sim).

The lighthouse part is not modelled: every heartbeat, Quorum call, stream
end, tick, decision and spare request is a call of lighthouse.core.membership's
`Membership` (and so of lighthouse.core.quorum's rule and lighthouse.core.spares'
placement), the code the server runs, with the virtual time as `now`. What
is modelled is everything around it, on a virtual clock that only events
move (a heap of timed events; the wall clock is read only to time the
membership calls):

- a group's process opens its heartbeat stream, heartbeats at the period the
  lighthouse advises (`Membership.advice_ms`, lighthouse.core.pacing), and calls
  Quorum at the start of every step;
- a step: the quorum is issued at virtual time t; the members train
  together until t + step_s * (1 + step_jitter * the slowest member's draw),
  commit, and call Quorum again within `join_spread_s`. A member at a lower
  step than the quorum's highest heals during that step (it trains nothing);
- the cost of a membership call: this thread's CPU time around it (less the
  clock's own cost), not the wall clock, which a shared machine inflates;
- the server's pacing of decisions: a Quorum call asks for a decision
  (`DecideSoon`), run at once or, with `measured_pacing`, no sooner than 10
  times the last decision's measured cost after it (lighthouse.shell.server's
  decide_soon); the tick runs every `quorum_tick_ms`;
- failures (bench._fleet_model): the process dies, its heartbeat stream ends
  (`stream_ended`), a Quorum call it had waiting is withdrawn; a step in
  flight with it fails for every member, who are told (a gone notice) and
  call Quorum again `abort_s` later; the group's process restarts
  `restart_s` later as a new replica id at step 0. With spares, waiting
  spares (TakeReplicaGroup) are handed the dead group's name by the
  lighthouse and join `spare_join_s` later; a restarted process asks for its
  own name and becomes a spare when a spare took it.

Not modelled: gRPC, asyncio and protobuf costs, the status page and
metrics the server feeds from the effects, network delays, hung (rather
than dead) processes, spares failing while they wait.
"""

from __future__ import annotations

import heapq
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench._fleet_model import FAULT_FREE, FailureModel, failure_schedule
from lighthouse.core.effects import AdviceChanged, DecideSoon, Fail, Issued, Outcome, Placed
from lighthouse.core.membership import Membership
from lighthouse.core.quorum import LighthouseConfig, QuorumMember

WALL_OFFSET = 1_700_000_000.0
"""Epoch seconds of virtual time 0 (an issued quorum's id is at least the wall clock in ms)."""
DECIDE_COST_FACTOR = 10
"""As lighthouse.shell.server: a call-triggered decision waits 10x the previous one's cost."""
RETRY_S = 1.0
"""A Quorum call that failed (superseded, refused) is made again this much later."""


@dataclass(frozen=True)
class FleetConfig:
    """One simulated run. Times in (virtual) seconds unless the name says ms."""

    n_groups: int
    seconds: float
    seed: int = 0
    step_s: float = 1.0
    step_jitter: float = 0.05
    join_spread_s: float = 0.05
    start_spread_s: float = 1.0
    """The fleet's processes start at uniform times in [0, start_spread_s)
    and call Quorum for the first step at start_spread_s (+ join_spread_s)."""
    warmup_s: float = 5.0
    """Costs, latencies and group-steps count from here to `seconds`."""
    restart_s: float = 60.0
    spares: int = 0
    spare_join_s: float = 1.0
    abort_s: float = 0.5
    failures: FailureModel = FAULT_FREE
    heartbeat_timeout_ms: int = 5000
    join_timeout_ms: int = 60000
    quorum_tick_ms: int = 100
    min_replicas: int = 1
    measured_pacing: bool = True
    """Pace decisions by their measured cost as the server does; False: a
    decision runs at the virtual time it is asked for (exact, for tests)."""


@dataclass
class Proc:
    """One replica group process (or a spare, while `name` is None)."""

    pid: str
    name: str | None = None
    rid: str = ""
    alive: bool = True
    step: int = 0
    ticket: int = 0
    """Its waiting Quorum call's ticket; 0 when none waits."""
    joined_at: float = 0.0
    join_epoch: int = 0
    """Bumped to void a scheduled Quorum call (the step was aborted, the process died)."""
    round: int | None = None
    """The step (our serial, not the quorum id) it trains in."""
    wanted: str = ""
    """The group name a restarted process asks for (TakeReplicaGroup)."""
    first_join_at: float = 0.0
    """The first Quorum call of a process of the starting fleet."""


@dataclass
class Round:
    """One issued quorum's step."""

    members: list[Proc]
    max_step: int
    failed: bool = False


@dataclass
class FleetResult:
    """What one run measured; costs in seconds of real time per membership call."""

    config: FleetConfig
    costs: dict[str, list[float]] = field(default_factory=dict)
    latency_virtual_s: list[float] = field(default_factory=list)
    """Per quorum: issue time minus the last member's Quorum call (virtual)."""
    latency_s: list[float] = field(default_factory=list)
    """latency_virtual_s plus the measured cost of the call that issued it."""
    issued_at: list[float] = field(default_factory=list)
    """Virtual time of each quorum issued (the whole run)."""
    trained: int = 0
    """Group-steps trained (committed, not healing) in the window."""
    fleet_steps: int = 0
    """Steps committed in the window."""
    failures: int = 0
    """Processes killed in the window (a failure hitting a group with no live process is void)."""
    failed_steps: int = 0
    """Steps in flight that a failure ended, in the window."""
    promotions: int = 0
    events: int = 0
    advice_ms: list[int] = field(default_factory=list)
    end_time: float = 0.0

    @property
    def window_s(self) -> float:
        return self.config.seconds - self.config.warmup_s

    def cpu_s(self) -> float:
        return sum(sum(v) for v in self.costs.values())


def group_name(index: int) -> str:
    return f"g{index:06d}"


class Fleet:
    """The simulation: `run()` plays it to `config.seconds` and returns the result."""

    def __init__(self, config: FleetConfig, clock: Callable[[], float] = time.thread_time) -> None:
        self.c = config
        self.clock = clock
        """Times the membership calls: this thread's CPU time by default, so
        other processes on a shared machine do not inflate the costs."""
        self.clock_overhead = clock_overhead(clock)
        self.m = Membership(
            LighthouseConfig(
                min_replicas=config.min_replicas,
                join_timeout_ms=config.join_timeout_ms,
                quorum_tick_ms=config.quorum_tick_ms,
                heartbeat_timeout_ms=config.heartbeat_timeout_ms,
            ),
            started_at=0.0,
        )
        self.now = 0.0
        self.rng = random.Random(f"{config.seed}/timing")
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.by_rid: dict[str, Proc] = {}
        self.by_name: dict[str, Proc] = {}
        self.by_ticket: dict[int, Proc] = {}
        self.spare_tickets: dict[int, Proc] = {}
        self.rounds: dict[int, Round] = {}
        self._next_round = 0
        self._decide_pending: float | None = None
        self._next_decide_ok = 0.0
        self._procs = 0
        self.result = FleetResult(config)
        self.times: list[float] = []
        """Virtual time of each event handled, in order (tests check it never goes back)."""

    # -- the event heap ----------------------------------------------------

    def at(self, t: float, kind: str, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    def run(self, record_times: bool = False) -> FleetResult:
        c = self.c
        for i in range(c.n_groups):
            proc = self._proc()
            # The job's first step starts together (model built, data loaded):
            # a first quorum of the earliest starters would make the rest heal.
            proc.first_join_at = c.start_spread_s + self.rng.uniform(0, c.join_spread_s)
            self.at(self.rng.uniform(0, c.start_spread_s), "start", (proc, group_name(i)))
        for _ in range(c.spares):
            self.at(0.0, "spare", self._proc())
        horizon = c.seconds
        for failure in failure_schedule(c.failures, c.seed, c.n_groups, horizon):
            self.at(failure.at, "fail", failure.groups)
        self.at(c.quorum_tick_ms / 1000, "tick")
        handlers: dict[str, Callable[[Any], None]] = {
            "hb": self._on_heartbeat,
            "join": self._on_join,
            "decide": self._on_decide,
            "tick": self._on_tick,
            "end": self._on_round_end,
            "start": self._on_start,
            "spare": self._on_spare,
            "fail": self._on_fail,
            "abort": self._on_abort,
        }
        heap = self._heap
        while heap and heap[0][0] <= horizon:
            t, _, kind, arg = heapq.heappop(heap)
            assert t >= self.now, "the virtual clock went back"
            self.now = t
            if record_times:
                self.times.append(t)
            self.result.events += 1
            handlers[kind](arg)
        self.result.end_time = self.now
        return self.result

    # -- timing the membership calls ---------------------------------------

    def _timed(self, kind: str, call: Callable[[], Outcome | None]) -> tuple[Outcome | None, float]:
        start = self.clock()
        out = call()
        cost = max(0.0, self.clock() - start - self.clock_overhead)
        if self.now >= self.c.warmup_s:
            self.result.costs.setdefault(kind, []).append(cost)
        return out, cost

    @property
    def wall(self) -> float:
        return WALL_OFFSET + self.now

    def _in_window(self) -> bool:
        return self.c.warmup_s <= self.now

    def _proc(self) -> Proc:
        self._procs += 1
        return Proc(pid=f"p{self._procs}")

    # -- events ----------------------------------------------------------

    def _on_start(self, arg: tuple[Proc, str]) -> None:
        """A process trains as group `name`: its stream opens, it heartbeats and calls Quorum."""
        proc, name = arg
        if not proc.alive:
            return
        proc.name, proc.rid, proc.step = name, f"{name}:{proc.pid}", 0
        self.by_name[name] = proc
        self.by_rid[proc.rid] = proc
        self.m.stream_opened(proc.rid)
        self._heartbeat(proc)
        if proc.first_join_at > self.now:
            proc.join_epoch += 1
            self.at(proc.first_join_at, "join", (proc, proc.join_epoch))
        else:
            self._join(proc)

    def _on_heartbeat(self, arg: tuple[Proc, str]) -> None:
        proc, rid = arg
        if proc.alive and proc.rid == rid:
            self._heartbeat(proc)

    def _heartbeat(self, proc: Proc) -> None:
        rid = proc.rid
        out, cost = self._timed("heartbeat", lambda: self.m.heartbeat(self.now, rid))
        assert out is not None
        self._apply(out, cost)
        period = self.m.advice_ms / 1000 * self.rng.uniform(0.98, 1.02)
        self.at(self.now + period, "hb", (proc, rid))

    def _on_join(self, arg: tuple[Proc, int]) -> None:
        proc, epoch = arg
        if proc.alive and proc.join_epoch == epoch:
            self._join(proc)

    def _join(self, proc: Proc) -> None:
        member = QuorumMember(proc.rid, address=f"http://{proc.rid}", step=proc.step)
        out, cost = self._timed("join", lambda: self.m.join(self.now, member))
        assert out is not None
        if out.error is None:
            proc.ticket, proc.joined_at = out.ticket, self.now
            self.by_ticket[out.ticket] = proc
        self._apply(out, cost)

    def _on_decide(self, due: float) -> None:
        if due != self._decide_pending:
            return  # brought forward by a `DecideSoon(now=True)`
        self._decide_pending = None
        if not self.m.participants:
            return
        out, cost = self._timed("decide", lambda: self.m.decide(self.now, self.wall))
        assert out is not None
        self._next_decide_ok = self.now + cost + DECIDE_COST_FACTOR * cost
        self._apply(out, cost)

    def _on_tick(self, _: None) -> None:
        out, cost = self._timed("tick", lambda: self.m.tick(self.now, self.wall))
        assert out is not None
        self._apply(out, cost)
        self.at(self.now + self.c.quorum_tick_ms / 1000, "tick")

    def _on_round_end(self, serial: int) -> None:
        """The step's members commit together (should_commit is a barrier)."""
        rnd = self.rounds.pop(serial)
        if rnd.failed:
            return
        counted = self._in_window()
        if counted:
            self.result.fleet_steps += 1
        for proc in rnd.members:
            if not proc.alive:
                continue
            if counted and proc.step == rnd.max_step:
                self.result.trained += 1
            proc.step, proc.round = rnd.max_step + 1, None
            self._schedule_join(proc, self.rng.uniform(0, self.c.join_spread_s))

    def _schedule_join(self, proc: Proc, after_s: float) -> None:
        proc.join_epoch += 1
        self.at(self.now + after_s, "join", (proc, proc.join_epoch))

    def _on_spare(self, proc: Proc) -> None:
        """A TakeReplicaGroup call (a spare, or a restarted process wanting its name)."""
        wanted = proc.wanted
        out, cost = self._timed(
            "spare_waits", lambda: self.m.spare_waits(self.now, proc.pid, wanted)
        )
        assert out is not None
        self.spare_tickets[out.ticket] = proc
        self._apply(out, cost)

    def _on_fail(self, groups: tuple[int, ...]) -> None:
        for g in groups:
            proc = self.by_name.get(group_name(g))
            if proc is not None and proc.alive:
                self._kill(proc)

    def _kill(self, proc: Proc) -> None:
        assert proc.name is not None
        if self._in_window():
            self.result.failures += 1
        proc.alive = False
        name, rid = proc.name, proc.rid
        del self.by_name[name]
        if proc.ticket:
            self.by_ticket.pop(proc.ticket, None)
            self._timed("withdraw", lambda: self.m.withdraw(rid, proc.ticket))
            proc.ticket = 0
        out, cost = self._timed("stream_ended", lambda: self.m.stream_ended(self.now, rid))
        assert out is not None
        if proc.round is not None:
            rnd = self.rounds.get(proc.round)
            if rnd is not None and not rnd.failed:
                rnd.failed = True
                if self._in_window():
                    self.result.failed_steps += 1
                self.at(self.now + self.c.abort_s, "abort", rnd)
        self._apply(out, cost)
        successor = self._proc()
        if self.c.spares:
            successor.wanted = name
            self.at(self.now + self.c.restart_s, "spare", successor)
        else:
            self.at(self.now + self.c.restart_s, "start", (successor, name))

    def _on_abort(self, rnd: Round) -> None:
        """The live members of a failed step heard of it (a gone notice) and ask again."""
        for proc in rnd.members:
            if proc.alive:
                proc.round = None
                self._schedule_join(proc, self.rng.uniform(0, self.c.join_spread_s))

    # -- effects ---------------------------------------------------------

    def _apply(self, out: Outcome, cost: float) -> None:
        for effect in out.effects:
            if isinstance(effect, DecideSoon):
                self._decide_soon(effect.now)
            elif isinstance(effect, Issued):
                self._issued(effect, cost)
            elif isinstance(effect, Placed):
                spare = self.spare_tickets.pop(effect.ticket)
                if effect.group != spare.wanted:
                    self.result.promotions += 1
                self.at(self.now + self.c.spare_join_s, "start", (spare, effect.group))
            elif isinstance(effect, Fail):
                proc = self.by_ticket.pop(effect.ticket, None)
                if proc is not None and proc.ticket == effect.ticket:
                    proc.ticket = 0
                    self._schedule_join(proc, RETRY_S)
            elif isinstance(effect, AdviceChanged):
                self.result.advice_ms.append(effect.advice_ms)

    def _decide_soon(self, now: bool) -> None:
        if self._decide_pending is not None and (not now or self._decide_pending <= self.now):
            return
        paced = self.c.measured_pacing and not now
        t = max(self.now, self._next_decide_ok) if paced else self.now
        self._decide_pending = t
        self.at(t, "decide", t)

    def _issued(self, issued: Issued, cost: float) -> None:
        members = []
        last_join = 0.0
        for ticket in issued.tickets:
            proc = self.by_ticket.pop(ticket)
            proc.ticket = 0
            last_join = max(last_join, proc.joined_at)
            members.append(proc)
        self._next_round += 1
        serial = self._next_round
        max_step = max(m.step for m in issued.quorum.participants)
        self.rounds[serial] = Round(members, max_step)
        for proc in members:
            proc.round = serial
        self.result.issued_at.append(self.now)
        if self._in_window():
            self.result.latency_virtual_s.append(self.now - last_join)
            self.result.latency_s.append(self.now - last_join + cost)
        slowest = self.rng.random() ** (1 / len(members))  # the max of len(members) uniforms
        train_s = self.c.step_s * (1 + self.c.step_jitter * slowest)
        self.at(self.now + train_s, "end", serial)


def clock_overhead(clock: Callable[[], float], samples: int = 2000) -> float:
    """The median cost of reading `clock` twice (subtracted from each timed call)."""
    gaps = []
    for _ in range(samples):
        start = clock()
        gaps.append(clock() - start)
    gaps.sort()
    return gaps[len(gaps) // 2]


def state_memory_bytes(n_groups: int) -> int:
    """Bytes (tracemalloc) the membership state holds for `n_groups` live groups
    that have heartbeated, trained one step together and all called Quorum again."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        m = Membership(LighthouseConfig(min_replicas=1), started_at=0.0)
        rids = [f"{group_name(i)}:p{i}" for i in range(n_groups)]
        for rid in rids:
            m.stream_opened(rid)
            m.heartbeat(0.0, rid)
            m.heartbeat(0.5, rid)
        for rid in rids:
            m.join(1.0, QuorumMember(rid, address=f"http://{rid}", step=0))
        m.decide(1.0, WALL_OFFSET + 1.0)
        for rid in rids:
            m.join(2.0, QuorumMember(rid, address=f"http://{rid}", step=1))
        size = tracemalloc.get_traced_memory()[0] - before
        del m
        return size
    finally:
        tracemalloc.stop()
