"""The control side of a server connection: SETTINGS, WINDOW_UPDATE, PING,
RST_STREAM and PRIORITY from the peer, refusals, and the keepalive PING.

These frames carry no call, so a peer can send them for the work they make
us do: each has a rate (lighthouse.rpc.h2.limits.FrameRates) or is charged
by what it costs, and a connection over a rate ends with GOAWAY
ENHANCE_YOUR_CALM, counted by kind.
"""

from __future__ import annotations

import collections
import time
from typing import Any, NoReturn

from lighthouse.rpc.h2.flow import StreamTable
from lighthouse.rpc.h2.frames import (
    ACK,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    MAX_WINDOW,
    PING,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    U32,
    ProtocolError,
    frame,
    settings,
    window_increment,
)
from lighthouse.rpc.h2.limits import FrameRates, Limits
from lighthouse.rpc.h2.shares import ProcessBudget

_KEEPALIVE = b"keepaliv"
"""Our PING's opaque data."""


class ControlFrames(StreamTable):
    """What a connection does with the peer's control frames; the connection
    (a subclass) reads frames and calls these."""

    def __init__(self, limits: Limits, budget: ProcessBudget) -> None:
        super().__init__(limits, budget)
        self._handler: Any = None
        self._work = 0
        """What is left of the work budget of the read under way."""
        self._last_stream = 0
        self._reset_by_peer: collections.deque[int] = collections.deque(maxlen=16)
        """The streams the peer reset last: a frame on one is its error (RFC 9113 5.1)."""
        self._ping_at = 0.0
        self._rates = FrameRates(limits)
        self.calmed = ""
        """The flood this connection was closed for, if any (`_calm`)."""
        self.reads = 0
        """Reads so far: the keepalive sees whether the peer sent anything."""
        self._reads_seen = 0
        self._quiet_since = time.monotonic()
        self._pinged_at = 0.0
        """When our keepalive PING went out (0: none unanswered)."""

    def keepalive(self, now: float) -> bool:
        """Called now and then (the server's sweep): a PING to a peer quiet
        for `keepalive_s`; False once one has gone unanswered `ping_timeout_s`
        (a peer that died without a FIN: the caller aborts)."""
        if self.reads != self._reads_seen:
            self._reads_seen, self._quiet_since, self._pinged_at = self.reads, now, 0.0
            return True
        if self._pinged_at:
            return now - self._pinged_at < self._limits.ping_timeout_s
        if now - self._quiet_since >= self._limits.keepalive_s:
            self._pinged_at = now
            self._write(frame(PING, 0, 0, _KEEPALIVE))
        return True

    def refused(self) -> None:
        """A call the handler ended for what its peer did (too many
        messages): rated as refused calls are, past which the connection is
        calmed."""
        if not self._rates.refused_call.take():
            self._calm("refused_call", "too many calls refused")

    def _priority(self, stream_id: int, payload: bytes) -> None:
        if U32.unpack_from(payload)[0] & MAX_WINDOW == stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "a stream that depends on itself", stream_id)
        if not self._rates.priority.take():
            self._calm("priority", "too many PRIORITY frames")

    def _settings(self, payload: bytes) -> None:
        """Charged to the work budget by what it costs: its entries, and the
        open streams walked when the initial window changes. That walk is
        done once a frame, with the last value: a frame of 2,730 entries
        walks the streams once, not 2,730 times."""
        if not self._rates.settings.take():
            self._calm("settings", "too many SETTINGS frames")
        pairs = settings(payload)
        self._work -= len(pairs)
        window = -1
        for key, value in pairs:
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
        if window >= 0 and window != self._peer_initial_window:
            delta, self._peer_initial_window = window - self._peer_initial_window, window
            self._work -= len(self._streams)
            for out in self._streams.values():
                out.window += delta
                if out.window > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
        self._write(frame(SETTINGS, ACK, 0, b""))
        self._flush_pending()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if stream_id > self._last_stream:
            raise ProtocolError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
        increment = window_increment(payload, stream_id)
        if stream_id == 0:
            if self._send_window + increment > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "a connection window over 2^31-1")
            self._send_window += increment
            if self._blocked and self._flush_pending():
                return
        elif (out := self._streams.get(stream_id)) is not None:
            if out.window + increment > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "a window over 2^31-1", stream_id)
            out.window += increment
            if stream_id in self._blocked and self._flush_pending(out):
                return
        else:
            if not self._rates.closed_stream.take():
                self._calm("closed_stream", "too many frames on closed streams")
            return
        # It unblocked nothing: free for the DATA frames we sent, then rated.
        if self._wu_earned > 0:
            self._wu_earned -= 1
        elif not self._rates.idle_window_update.take():
            self._calm("window_update", "too many WINDOW_UPDATEs with nothing to send")

    def _ping(self, payload: bytes) -> None:
        """Answered, but a peer that pings faster than `ping_interval_s`
        while we answer nothing else gets a strike (C-core's policy)."""
        now = time.monotonic()
        if not self._answered and now - self._ping_at < self._limits.ping_interval_s:
            self._ping_strikes += 1
            if self._ping_strikes > self._limits.ping_strikes:
                self._calm("ping", "too many pings")
        self._ping_at, self._answered = now, False
        self._write(frame(PING, ACK, 0, payload))

    def _peer_reset(self, stream_id: int) -> None:
        if stream_id > self._last_stream:
            raise ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        if stream_id in self._streams:
            if not self._rates.reset.take():
                self._calm("reset", "too many streams reset")
            self._forget(stream_id)
            self._reset_by_peer.append(stream_id)
            self._handler.on_closed(self, stream_id)
        elif not self._rates.closed_stream.take():
            self._calm("closed_stream", "too many frames on closed streams")

    def _refuse(self, stream_id: int, code: int) -> None:
        """RST_STREAM on a stream the peer made us end (resets are rate-bounded)."""
        if not self._rates.reset.take():
            self._calm("reset", "too many streams refused")
        self._write(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def refuse_call(self, stream_id: int, headers: bytes, trailers: bytes | None) -> None:
        """Answers a call that will not run (an unknown method, a refused
        secret, an unsupported encoding; `trailers` None: not gRPC, reset).
        Refusals cost us a decode and an answer, so they are rated; and they
        do not clear PING strikes, or refused calls would buy a PING flood."""
        if not self._rates.refused_call.take():
            self._calm("refused_call", "too many calls refused")
        if trailers is None:
            self.reset(stream_id, PROTOCOL_ERROR)
            return
        answered, strikes = self._answered, self._ping_strikes
        self.send(stream_id, headers, b"", trailers)
        self._answered, self._ping_strikes = answered, strikes

    def _calm(self, kind: str, why: str) -> NoReturn:
        """A flood of frames or calls that do no work: the connection ends
        with GOAWAY ENHANCE_YOUR_CALM (logged once per host), counted by kind
        in the process budget."""
        self.calmed = kind
        counts = self._budget.calmed
        counts[kind] = counts.get(kind, 0) + 1
        raise ProtocolError(ENHANCE_YOUR_CALM, why)
