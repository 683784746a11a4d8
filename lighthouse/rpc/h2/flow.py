"""The streams of one server connection and their flow control, both ways.

Receiving, the windows are honest: what the peer may send comes back as
the handler consumes messages, not as bytes arrive, so a stream holds at
most its window (or the grant of a message it declared), a connection at
most its window and grants, and all connections together the process
budget. Sending, an answer waits on the peer's windows; what waits is
counted, so the connection can refuse new streams while it is high.
"""

from __future__ import annotations

import time

from lighthouse.rpc.h2.frames import (
    CANCEL,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    HEADER,
    HEADERS,
    RST_STREAM,
    U32,
    WINDOW_UPDATE,
    frame,
)
from lighthouse.rpc.h2.limits import Limits
from lighthouse.rpc.h2.shares import ProcessBudget

_MAX_EARNED = 10_000
"""The most WINDOW_UPDATEs DATA frames sent may earn ahead (`_wu_earned`)."""


class Stream:
    """An open stream: its send side (window, what waits on it) and its
    receive side (credit given, bytes held by the handler, the limit)."""

    __slots__ = ("sid", "window", "pending", "end_after", "credit", "held", "limit", "remote_done")

    def __init__(self, sid: int, window: int, limit: int, remote_done: bool) -> None:
        self.sid = sid
        self.window = window
        self.pending = bytearray()
        self.end_after: bytes | None = None
        """A header block (trailers) to send with END_STREAM once pending is out."""
        self.credit = limit
        """What the peer may still send on it."""
        self.held = 0
        """Bytes the handler has and has not consumed."""
        self.limit = limit
        """credit + held stay within it: the stream window, or a message's grant."""
        self.remote_done = remote_done
        """The peer sent END_STREAM (half-closed, remote)."""


class StreamTable:
    """A connection's open streams and windows; the connection (a subclass)
    writes frames (`_write`) and reads what the peer sends."""

    def __init__(self, limits: Limits, budget: ProcessBudget) -> None:
        self._limits = limits
        self._budget = budget
        self.host = ""
        """The peer's address without its port: whose share of the process's
        pools (ProcessBudget) this connection draws on."""
        self._streams: dict[int, Stream] = {}
        self.idle_since: float | None = time.monotonic()
        """When its last stream closed (None: streams are open): the server's
        idle sweep and connection cap read it."""
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._blocked: set[int] = set()
        """Open streams with data waiting on flow control."""
        self._unsent = 0
        """Bytes of answers waiting on flow control, all streams (`_queued`)."""
        self.blocked_since: float | None = None
        """Since when answers wait on the peer's windows with none sent (the
        server's sweep drops a connection that reads none for too long)."""
        self._credit = DEFAULT_WINDOW
        """What the peer may still send on the connection."""
        self._held = 0
        self._granted = 0
        self._conn_limit = limits.connection_window
        """What the peer may send on the connection, with what is held: the
        connection window and the grants."""
        self._answered = True
        """An answer (HEADERS or DATA) went out since the last PING."""
        self._ping_strikes = 0
        self._wu_earned = 0
        """WINDOW_UPDATEs the peer may send for DATA frames we sent
        (`Limits.window_updates_per_data` each) before its rate applies."""

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    # ---- receive flow control ------------------------------------------------------------

    def consumed(self, stream_id: int, nbytes: int) -> None:
        """The handler is done with `nbytes` of the stream's data: the peer
        may send that much again."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.held:
            return  # closed: what it held was released then
        if nbytes > stream.held:
            nbytes = stream.held
        stream.held -= nbytes
        self._held -= nbytes
        self._budget.held.release(self.host, nbytes)
        if not stream.held and stream.limit > self._limits.stream_window:
            self._ungrant(stream)
        self._give_back(stream)

    def grant(self, stream_id: int, nbytes: int) -> bool:
        """Lets the stream hold `nbytes` unconsumed (a message it declared
        larger than the stream window) until it has consumed them all;
        False if this connection's or the process's grants are spent."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return False
        more = nbytes - stream.limit
        if more <= 0:
            return True
        if self._granted + more > self._limits.max_grant:
            return False
        if not self._budget.grants.take(self.host, more):
            return False
        self._granted += more
        self._conn_limit += more
        stream.limit += more
        self._give_back(stream, at_once=True)
        return True

    def _ungrant(self, stream: Stream) -> None:
        extra = stream.limit - self._limits.stream_window
        stream.limit -= extra
        self._granted -= extra
        self._conn_limit -= extra
        self._budget.grants.release(self.host, extra)

    def _give_back(self, stream: Stream | None, at_once: bool = False) -> None:
        """Window updates for what is consumed: each window's limit less the
        credit the peer has and what is held, once that is half the limit."""
        if stream is not None and not stream.remote_done:
            limit = stream.limit
            owed = limit - stream.credit - stream.held
            if owed > 0 and (at_once or owed >= limit >> 1):
                stream.credit += owed
                self._write(frame(WINDOW_UPDATE, 0, stream.sid, U32.pack(owed)))
        limit = self._conn_limit
        owed = limit - self._credit - self._held
        if owed > 0 and (at_once or owed >= limit >> 1):
            self._credit += owed
            self._write(frame(WINDOW_UPDATE, 0, 0, U32.pack(owed)))

    # ---- frames out ---------------------------------------------------------------

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def send(
        self, stream_id: int, headers: bytes | None, data: bytes, trailers: bytes | None
    ) -> None:
        """Sends a header block (None: none), `data` as DATA frames as flow
        control allows (the rest when the peer opens its window), and
        `trailers` with END_STREAM after them (None: the stream goes on).
        The stream is done once its trailers are out. A closed stream
        sends nothing."""
        out = self._streams.get(stream_id)
        if out is None:  # ended, or the connection is gone
            return
        self._answered = True
        self._ping_strikes = 0
        chunks = []
        if headers is not None:
            chunks.append(frame(HEADERS, END_HEADERS, stream_id, headers))
        if out.pending or out.end_after is not None:
            out.pending += data
            self._queued(len(data))
        elif data:
            sent = self._data_frames(stream_id, out, data, chunks)
            out.pending += data[sent:]
            self._queued(len(data) - sent)
        if out.pending:
            self._blocked.add(stream_id)
            if self.blocked_since is None:
                self.blocked_since = time.monotonic()
        if trailers is not None:
            if out.pending:
                out.end_after = trailers
            else:
                chunks.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, trailers))
                self._forget(stream_id)
        if chunks:
            self._write(b"".join(chunks))

    def _data_frames(
        self, stream_id: int, out: Stream, data: bytes | memoryview, chunks: list[bytes]
    ) -> int:
        """Appends DATA frames of `data` that the windows allow; returns bytes
        framed. Only those bytes are sliced: `data` may be a view of what waits."""
        allowed = min(len(data), out.window, self._send_window)
        if allowed <= 0:
            return 0
        step = self._peer_max_frame
        for pos in range(0, allowed, step):
            piece = data[pos : min(pos + step, allowed)]
            length = len(piece)
            chunks.append(HEADER.pack(length >> 16, length & 0xFFFF, DATA, 0, stream_id) + piece)
        out.window -= allowed
        self._send_window -= allowed
        earned = self._wu_earned + self._limits.window_updates_per_data * (
            (allowed + step - 1) // step
        )
        self._wu_earned = earned if earned < _MAX_EARNED else _MAX_EARNED
        return allowed

    def _flush_pending(self, only: Stream | None = None) -> int:
        """Sends what waited on flow control as the windows now allow (`only`:
        that stream's); returns the bytes sent. Only streams with data waiting
        and an open window are visited, and only the newly allowed bytes are
        sliced: a peer's WINDOW_UPDATE costs what it unblocks, no more."""
        if self._send_window <= 0 or not self._blocked:
            return 0  # the usual case, on each of a client's WINDOW_UPDATEs
        chunks: list[bytes] = []
        done: list[Stream] = []
        total = 0
        for stream_id in (only.sid,) if only is not None else self._blocked:
            out = self._streams[stream_id]
            if out.window <= 0:
                continue
            with memoryview(out.pending) as waiting:
                sent = self._data_frames(stream_id, out, waiting, chunks)
            del out.pending[:sent]  # from the front: no copy of the rest
            total += sent
            if not out.pending:
                done.append(out)
                if out.end_after is not None:
                    chunks.append(
                        frame(HEADERS, END_HEADERS | END_STREAM, stream_id, out.end_after)
                    )
            if self._send_window <= 0:
                break
        self._queued(-total)
        for out in done:  # not while the set is iterated
            self._blocked.discard(out.sid)
            if out.end_after is not None:
                self._forget(out.sid)
        if total:  # progress: the stall clock starts again
            self.blocked_since = time.monotonic() if self._blocked else None
        if chunks:
            self._write(b"".join(chunks))
        return total

    def _queued(self, nbytes: int) -> None:
        """Answer bytes now waiting on the peer's windows (negative: no
        longer), counted in the process's memory, as they are held whether
        or not the host's share has room."""
        self._unsent += nbytes
        if nbytes > 0:
            self._budget.memory.add(self.host, nbytes)
        elif nbytes < 0:
            self._budget.memory.release(self.host, -nbytes)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """Ends a stream at once (RST_STREAM); nothing more is sent on it."""
        if stream_id in self._streams:
            self._forget(stream_id)
            self._write(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def _forget(self, stream_id: int) -> None:
        """A stream is done: what it held and was granted is released."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        if stream_id in self._blocked:
            self._blocked.discard(stream_id)
            self._queued(-len(stream.pending))
            if not self._blocked:
                self.blocked_since = None
        if stream.held:
            self._held -= stream.held
            self._budget.held.release(self.host, stream.held)
            stream.held = 0
        if stream.limit > self._limits.stream_window:
            self._ungrant(stream)
        if not self._streams:
            self.idle_since = time.monotonic()
        self._give_back(None)
