"""A step's collectives end at once when a member of its quorum is gone.

Why: a replica group that dies or hangs (SIGSTOP, a frozen host) inside a
collective holds every other member of it until the collective timeout,
though the lighthouse knows within about a heartbeat timeout. The
lighthouse tells the quorum's live members (lighthouse.core.gone: a notice
"quorum Q: members X gone" on rank 0's HeartbeatPaced stream). The
ManagerServer keeps only notices about its group's latest quorum that name
one of its members (`GroupNotices`: one that comes before the group has
taken in its quorum waits for it) and hands them to rank 0's Manager in
process; rank 0 publishes them in the group's TCPStore, where a watcher
thread of each other rank is blocked on its next key. Each rank then breaks
its step of quorum Q (`StepBreaks`): the allreduces in flight complete at
once with the error (InOrderCollectives.abort), so the training thread
stops waiting, the process group is aborted, later collectives of the step
fail, the step votes no, and the next quorum forms without the gone group.

No false alarms: a notice for another quorum id, or naming no member of our
quorum, does nothing; and a step whose collectives had all completed is not
failed (a group that finished its last step and left costs the others
nothing). The lighthouse never issues a quorum id again after a notice
about it, so a notice never reaches a later quorum's step.

The gone member itself, continued (SIGCONT) within the collective timeout,
could complete its collective with the others' abandoned ones and commit a
step they did not (the same step number, other weights). It is told it is
gone when it heartbeats again, but that races its vote; so every rank also
watches its own process: a step during which it was frozen for
FROZEN_S or more (long enough for the lighthouse to suspect it) does
not commit (`check_frozen`).

The default mechanism is in-process abandon: the Manager settles its own
futures at once, and ProcessGroupGloo drops the group. The abandoned gloo
collective (which gloo cannot interrupt: it runs on to its timeout on the
dropped group) never writes into a tensor in use: Manager.allreduce
reduces a private copy, and DDP, which reduces its buckets in place, trains
on new buckets after an abort (InOrderCollectives). ProcessGroupBabyGloo's
abort kills the child process that runs gloo instead. Measured
(tests/e2e/test_gone_abort.py, 30 s collective timeout, 1 s heartbeat
timeout, medians of 5 runs on a shared 2-core box),
the survivors' longest stall with one group stopped inside a collective was
0.79 s (2 groups) and 0.84 s (3 groups) in process, 0.84 s and 0.89 s with
the baby when its standby child was warm, and 2.5 to 3 s when the fault
came soon after a reconfigure (the next child was still importing torch);
each of its collectives also pays a round trip to the child. (A group
SIGKILLed inside one cost 0.13 s with or without notices: gloo sees its
sockets close.) So the Manager's default stays in process
(ProcessGroupGloo). The baby is for jobs where a gone member that comes
back within the collective timeout must find its collective failed: in
process it may complete with our abandoned ones (it is told it is gone,
lighthouse.core.gone, but may commit first; the next quorum heals it).

On GPUs, ProcessGroupNCCL's abort is ncclCommAbort on a non-blocking
communicator: it ends the collective in flight on the device, so nothing
runs on; ProcessGroupBabyNCCL kills its child as the gloo baby does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from lighthouse.loop import set_batch_policy
from torchft_like.collectives import InOrderCollectives
from torchft_like.manager.config import ManagerConfig

logger = logging.getLogger(__name__)

KEEP_BROKEN = 16
"""Broken quorum ids remembered (a notice may come before its step's quorum)."""
GONE_KEY = "torchft_like/gone/"
"""Store key prefix of the notices rank 0 publishes for the other ranks."""
STOP = "stop"
FROZEN_S = 0.6
"""A process silent this long may be judged hung (the lighthouse's default
floor is 0.7 s, checked every 0.1 s)."""
TICK_S = 0.1
ABANDONED_WAIT_S = 30.0
"""How long close() waits for setups abandoned to their timeout (a store connect: 5-15 s)."""


class MemberGoneError(RuntimeError):
    """A member of this step's quorum is gone: the step's collectives are aborted."""


def gone_in_quorum(
    quorum_id: int, gone: Iterable[str], latest: tuple[int, tuple[str, ...] | None] | None
) -> tuple[str, ...]:
    """The gone replicas that are members of `latest` (quorum id, member
    ids), the group's latest quorum; () for a notice about another quorum.
    Members None (a group that took in its view, not the member list): the
    lighthouse sends a notice only to the gone members' quorum, so all count."""
    if latest is None or quorum_id != latest[0]:
        return ()
    if latest[1] is None:
        return tuple(sorted(set(gone)))
    members = set(latest[1])
    return tuple(sorted(rid for rid in gone if rid in members))


class GroupNotices:
    """Rank 0's ManagerServer side: which notices concern the group's latest
    quorum. A notice can come before the group has taken in the quorum it
    is about (the gone member's stream closed while the quorum's answer was
    on its way): it is kept, a few, until that quorum is the group's.

    `heard` and `applied` return the gone members to pass on now, or ()."""

    def __init__(self, keep: int = KEEP_BROKEN) -> None:
        self.latest: tuple[int, tuple[str, ...] | None] | None = None
        self._early: dict[int, tuple[str, ...]] = {}
        self._keep = keep

    def heard(self, quorum_id: int, gone: tuple[str, ...]) -> tuple[str, ...]:
        if self.latest is not None and quorum_id < self.latest[0]:
            return ()  # about an older quorum: its step is over
        if self.latest is None or quorum_id != self.latest[0]:
            self._early[quorum_id] = self._early.get(quorum_id, ()) + gone
            while len(self._early) > self._keep:
                del self._early[next(iter(self._early))]
            return ()
        return gone_in_quorum(quorum_id, gone, self.latest)

    def applied(self, quorum_id: int, members: tuple[str, ...] | None) -> tuple[str, ...]:
        self.latest = (quorum_id, members)
        early = self._early.pop(quorum_id, ())
        return gone_in_quorum(quorum_id, early, self.latest) if early else ()


class StepBreaks:
    """Which quorums are broken, and whether this rank's current step is one.

    `notice` and `quorum_applied` each return the gone members when the
    step must abort now; None otherwise. Not thread-safe (StepBreaker locks).
    """

    def __init__(self, keep: int = KEEP_BROKEN) -> None:
        self.broken: dict[int, tuple[str, ...]] = {}
        self.step_quorum: int | None = None
        """The quorum id applied for the current step; None before it is."""
        self._keep = keep

    def notice(self, quorum_id: int, gone: tuple[str, ...]) -> tuple[str, ...] | None:
        self.broken[quorum_id] = gone
        while len(self.broken) > self._keep:
            del self.broken[next(iter(self.broken))]
        return gone if self.step_quorum == quorum_id else None

    def step_started(self) -> None:
        self.step_quorum = None

    def quorum_applied(self, quorum_id: int) -> tuple[str, ...] | None:
        self.step_quorum = quorum_id
        return self.broken.get(quorum_id)


def _key(replica_id: str, rank: int, seq: int) -> str:
    return f"{GONE_KEY}{replica_id}/{rank}/{seq}"


class StepBreaker:
    """One rank's side: hears the gone notices and breaks its step of a
    quorum that lost a member (the lighthouse's side, which judges who is
    gone, is lighthouse.core.gone.GoneWatch).

    Args:
        config: the Manager's (the group's store, this rank, the group's size).
        store: the group's store (rank 0 publishes in it).
        replica_id: the group's `{name}:{uuid}`.
        manager_server: rank 0's ManagerServer (None on the other ranks).
        collectives: the Manager's collectives, aborted on a notice.
        pg: the process group; its `abort()` is called if it has one.
        log: the Manager's logger.
    """

    def __init__(
        self,
        config: ManagerConfig,
        store: Any,
        replica_id: str,
        manager_server: Any,
        collectives: InOrderCollectives,
        pg: Any,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self._store, self._prefix, self._replica_id = store, config.store_prefix, replica_id
        self._rank, self._world_size = config.rank, config.world_size
        self._collectives, self._pg, self._log = collectives, pg, log
        self._breaks = StepBreaks()
        self._lock = threading.Lock()
        self._heard = threading.Condition(self._lock)
        """Notified on each notice: a quorum's setup waits on it (`unless_gone`)."""
        self._published = 0
        self._watch_seq = 0
        """The key the watcher waits on (another rank)."""
        self._stopped = False
        self._abandoned: list[threading.Thread] = []
        """Setup threads left running to their timeout (unless_gone): joined by close."""
        self._watcher: threading.Thread | None = None
        self._ticked = time.monotonic()
        self._longest_gap = 0.0
        """The longest gap between ticks of `_tick` this step: was the process frozen?"""
        self._ticker = threading.Thread(
            target=self._tick,
            args=(config.control_sched == "batch",),
            name="torchft_freeze_watch",
            daemon=True,
        )
        self._ticker.start()
        if manager_server is not None:
            manager_server.add_gone_listener(self._heard_in_server)
        elif config.world_size > 1:
            watch_store = TCPStore(
                config.store_addr,
                config.store_port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(days=1),
            )
            self._watcher = threading.Thread(
                target=self._watch, args=(watch_store,), name="torchft_gone_watch", daemon=True
            )
            self._watcher.start()

    def new_step(self) -> None:
        """The step starts: its quorum is not known yet."""
        with self._lock:
            self._breaks.step_started()
        self._collectives.reset()
        self._longest_gap = 0.0

    def check_frozen(self, report_error: Callable[[Exception], None]) -> None:
        """Before the vote: a step during which this process was frozen long
        enough to be judged gone must not commit (see the module's docstring)."""
        frozen_s = max(self._longest_gap, time.monotonic() - self._ticked)
        if frozen_s >= FROZEN_S:
            report_error(
                MemberGoneError(
                    f"this process was frozen {frozen_s:.1f} s during the step (stopped?): the "
                    "lighthouse may have left this group out, and the others abandoned the "
                    "step's collectives"
                )
            )

    def _tick(self, batch: bool) -> None:
        set_batch_policy(batch)  # its 10 wake-ups a second need not preempt training
        while not self._stopped:
            time.sleep(TICK_S)
            now = time.monotonic()
            self._longest_gap = max(self._longest_gap, now - self._ticked)
            self._ticked = now

    def quorum_applied(self, quorum_id: int) -> None:
        """This step's quorum is `quorum_id`: aborts at once if it is broken."""
        with self._lock:
            gone = self._breaks.quorum_applied(quorum_id)
        if gone is not None:
            self._abort(quorum_id, gone)

    def notice(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        """Members `gone` of quorum `quorum_id` are gone."""
        with self._lock:
            now = self._breaks.notice(quorum_id, gone)
            self._heard.notify_all()
        if now is not None:
            self._abort(quorum_id, now)

    def join(self, quorum_id: int, store: str, replica_id: str, rank: int, size: int) -> None:
        """Configures the process group for quorum `quorum_id` unless a member
        of it is gone, before or during the setup (`unless_gone`): then the
        group it was joining is aborted, and never installed.

        Raises:
            MemberGoneError: a member of the quorum is gone.
        """
        try:
            self.unless_gone(
                quorum_id,
                lambda: self._pg.configure(store, replica_id, rank, size),
                "process group setup",
            )
        except MemberGoneError:
            if hasattr(self._pg, "abort"):
                self._pg.abort()
            raise

    def unless_gone(self, quorum_id: int, work: Callable[[], None], what: str) -> None:
        """Runs `work`, a blocking part of quorum `quorum_id`'s setup (the
        process group joining it: store connects, rendezvous), and returns
        when it ends, or raises MemberGoneError as soon as a member of that
        quorum is known gone, before or during it. Its waits are bounded
        only by the collective timeout, which a gone member would use up;
        abandoned, the work runs on in its thread to that timeout, and the
        caller aborts what it was building.

        Raises:
            MemberGoneError: a member of the quorum is gone.
            Exception: what `work` raised.
        """
        outcome: list[BaseException] = []
        finished = threading.Event()

        def run() -> None:
            try:
                work()
            except BaseException as e:
                outcome.append(e)
            finally:
                with self._lock:
                    finished.set()
                    self._heard.notify_all()

        thread = None
        with self._lock:
            gone = self._breaks.broken.get(quorum_id)
            if gone is None:
                name = f"torchft_{what.replace(' ', '_')}"
                thread = threading.Thread(target=run, name=name, daemon=True)
                thread.start()
                while not finished.is_set() and gone is None:
                    self._heard.wait()
                    gone = self._breaks.broken.get(quorum_id)
        if gone is not None and not finished.is_set():
            if thread is not None:  # (none started when the quorum was broken already)
                self._abandoned = [t for t in self._abandoned if t.is_alive()] + [thread]
            raise MemberGoneError(
                f"quorum {quorum_id}: replica group(s) {', '.join(gone)} gone (the lighthouse "
                f"says so) while this rank was in its {what}; asking for the next quorum"
            )
        if outcome:
            raise outcome[0]

    def _abort(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        error = MemberGoneError(
            f"quorum {quorum_id}: replica group(s) {', '.join(gone)} gone (the lighthouse "
            "says so); aborting this step's collectives"
        )
        in_flight = self._collectives.abort(error)
        self._log.warning("%s (%d in flight)", error, in_flight)
        # Only a collective in flight is reason to drop the group: a step
        # whose collectives all completed still commits.
        if in_flight and hasattr(self._pg, "abort"):
            try:
                self._pg.abort()
            except Exception as e:
                self._log.warning("aborting the process group failed: %s", e)

    def _heard_in_server(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        """Rank 0, on the ManagerServer's loop: off it at once (publishing and
        settling futures run DDP's callbacks, which must not hold the loop)."""
        threading.Thread(
            target=self._publish_and_notice,
            args=(quorum_id, gone),
            daemon=True,
            name="torchft_gone_notice",
        ).start()

    def _publish_and_notice(self, quorum_id: int, gone: tuple[str, ...]) -> None:
        if self._world_size > 1:
            value = json.dumps([quorum_id, list(gone)])
            with self._lock:
                seq, self._published = self._published, self._published + 1
            try:
                for rank in range(1, self._world_size):
                    self._store.set(self._prefix + _key(self._replica_id, rank, seq), value)
            except Exception as e:  # the store is gone: so is the group
                self._log.warning("could not pass a gone notice to the other ranks: %s", e)
        self.notice(quorum_id, gone)

    def _watch(self, store: Any) -> None:
        """Another rank: waits on each next key rank 0 publishes for it."""
        while not self._stopped:
            key = self._prefix + _key(self._replica_id, self._rank, self._watch_seq)
            try:
                store.wait([key])
                value = store.get(key).decode()
            except Exception as e:  # the store closed: the group is ending
                logger.debug("gone watcher stops: %s", e)
                return
            if value == STOP:
                return
            self._watch_seq += 1
            try:
                quorum_id, gone = json.loads(value)
                self.notice(int(quorum_id), tuple(str(g) for g in gone))
            except (ValueError, TypeError) as e:
                self._log.warning("ignoring a malformed gone notice %r: %s", value, e)

    def close(self) -> None:
        """Stops the threads: the watcher wakes on a stop at the key it waits on.
        A setup left running to its timeout is waited for (at most
        ABANDONED_WAIT_S): a daemon thread still inside a store connect when
        the interpreter exits aborts the process ("terminate called without
        an active exception")."""
        self._stopped = True
        self._ticker.join(2 * TICK_S + 1)
        deadline = time.monotonic() + ABANDONED_WAIT_S
        for thread in self._abandoned:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._log.warning(
                    "an abandoned %s still runs after %.0f s; exiting now may abort the process",
                    thread.name,
                    ABANDONED_WAIT_S,
                )
                break
        watcher, self._watcher = self._watcher, None
        for _ in range(3):
            if watcher is None or not watcher.is_alive():
                return
            try:
                key = _key(self._replica_id, self._rank, self._watch_seq)
                self._store.set(self._prefix + key, STOP)
            except Exception:
                return  # the store is gone: so is the watcher's wait
            watcher.join(1.0)
