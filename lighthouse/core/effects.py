"""The effects of lighthouse.core.membership's events, as values the server acts on."""

from __future__ import annotations

from dataclasses import dataclass, field

from lighthouse.core.gone import Gone
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.rpc.errors import QuorumError


@dataclass(frozen=True)
class Fail:
    """The waiting call `ticket` ends with `error` (superseded, left, another rendezvous)."""

    ticket: int
    error: QuorumError


@dataclass(frozen=True)
class Issued:
    """A quorum was issued; the calls `tickets` get it."""

    quorum: Quorum
    tickets: tuple[int, ...]
    changed: bool
    """Its members (or a commit failure) changed, so it has a new id."""
    news: bool
    """Worth an INFO line: a change, or the end of a logged stall."""
    reason: str
    prev_ids: tuple[str, ...]
    """The previous quorum's members."""
    absent: dict[str, str] = field(default_factory=dict)
    """Previous members not in this quorum -> why (lighthouse.core.history.why_absent);
    filled only when `changed`."""


@dataclass(frozen=True)
class Placed:
    """The waiting TakeReplicaGroup call `ticket` trains as `group`."""

    ticket: int
    group: str


@dataclass(frozen=True)
class Handed:
    """`group` was handed to `spare_id` (its first rank to be placed)."""

    spare_id: str
    group: str
    wanted: str

    @property
    def promotion(self) -> bool:
        """A spare took a dead group's name (not the one it asked for)."""
        return self.group != self.wanted


@dataclass(frozen=True)
class Joined:
    """A Quorum call described `member` (its step, any heal report)."""

    member: QuorumMember


@dataclass(frozen=True)
class Forgotten:
    """Every trace of `replica_id` was dropped (a Leave, or a long silence)."""

    replica_id: str
    why: str


@dataclass(frozen=True)
class TwinRefused:
    """A second live replica of one group was refused (once per replica)."""

    replica_id: str
    reason: str


@dataclass(frozen=True)
class AdviceChanged:
    """The heartbeat period advised on HeartbeatPaced streams changed."""

    advice_ms: int


@dataclass(frozen=True)
class DecideSoon:
    """Waiting calls changed: run `decide` soon (the server batches calls),
    or at once when every replica heard of is waiting: none is left to batch."""

    now: bool = False


@dataclass(frozen=True)
class JudgeGoneSoon:
    """A stream ended: run `judge_gone` soon, once for every stream that
    ends meanwhile (N ending together would otherwise cost O(N^2))."""


@dataclass(frozen=True)
class Log:
    """A change worth a log line, %-style."""

    level: int
    msg: str
    args: tuple[object, ...] = ()


Effect = (
    Fail
    | Issued
    | Placed
    | Handed
    | Joined
    | Forgotten
    | TwinRefused
    | AdviceChanged
    | Gone
    | DecideSoon
    | JudgeGoneSoon
    | Log
)
"""Each effect an event may have (`Outcome.effects`)."""


@dataclass(frozen=True)
class Outcome:
    """What an event leads to."""

    effects: tuple[Effect, ...] = ()
    error: Exception | None = None
    """The calling RPC's refusal (a twin, bad input); its effects still apply."""
    ticket: int = 0
    """The call's ticket (join, spare_waits): name it to `withdraw`/`spare_ends`."""
