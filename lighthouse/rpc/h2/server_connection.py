"""The server side of one HTTP/2 connection (RFC 9113) on an asyncio Protocol.

Just what a gRPC server needs: framing, HPACK decoding (the `hpack`
library), both directions' flow control, SETTINGS, PING, RST_STREAM and
GOAWAY. Requests go to a `StreamHandler` as decoded headers and data;
answers are written with `send`, and `reset`.

Anyone who reaches the port speaks to this class before any secret is
checked, so everything a peer can make it hold or do is bounded
(lighthouse.rpc.h2.limits): header blocks before they are decoded; request
bytes by honest flow control (windows given back as the handler consumes
messages, not as bytes arrive) and the process's pools, shared fairly
between hosts (lighthouse.rpc.h2.shares); answers by write backpressure (a
connection whose answers are not taken is not read further) and a stall
timer; control frames by rate (control_frames); the loop time of one read
by a work budget, per connection and per host, charged by what the work
costs. A broken rule ends the stream or the connection with the error RFC
9113 names, logged once per peer host.

Why not grpcio's server: a unary call costs it ~600 us of CPU on this
box whatever the handler does (thread hand-offs between its poller and the
event loop, ~18 syscalls a call; bench/NOTES.md). Here a call is one
`data_received` and one `write` on the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import hpack

from lighthouse.rpc.h2 import corking
from lighthouse.rpc.h2.control_frames import ControlFrames
from lighthouse.rpc.h2.flow import Stream
from lighthouse.rpc.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    U32,
    WINDOW_UPDATE,
    ProtocolError,
    check_frame,
    frame,
    frame_at,
    header_fragment,
    unpad,
)
from lighthouse.rpc.h2.header_lists import MALFORMED, HeaderLists
from lighthouse.rpc.h2.limits import LIMITS, Limits, PeerLog
from lighthouse.rpc.h2.shares import ProcessBudget

logger = logging.getLogger(__name__)
_peer_log = PeerLog(logger)

_NEW_STREAM_WORK = 8
"""A new stream's share of `Limits.work_per_read`: a call, not just a frame."""


class StreamHandler(Protocol):
    """What a connection calls, on the loop's thread, for each stream's events."""

    def on_headers(self, conn: Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        """A new request's headers (the stream is open; refuse with `reset`)."""

    def on_data(self, conn: Connection, stream_id: int, data: bytes, end: bool) -> None:
        """Body bytes of an open stream; `end`: the peer sent its last. The
        bytes count against the peer's windows until `consumed` says so."""

    def on_closed(self, conn: Connection, stream_id: int) -> None:
        """The stream ended abnormally: RST_STREAM, or the connection is gone."""


class Admission(Protocol):
    """Who counts a server's connections (lighthouse.rpc.h2.connections)."""

    def admit(self, conn: Connection) -> bool:
        """Whether `conn` (its host known) may stay; it may close others to make room."""

    def lost(self, conn: Connection) -> None:
        """`conn` has gone."""


class Connection(ControlFrames, asyncio.Protocol):
    """One client connection. Streams are ids the handler owns; the
    StreamTable keeps their flow control, ControlFrames the control frames,
    this class the protocol and the connection's bounds."""

    def __init__(
        self,
        handler: StreamHandler,
        admission: Admission | None = None,
        limits: Limits = LIMITS,
        budget: ProcessBudget | None = None,
    ) -> None:
        super().__init__(limits, budget if budget is not None else ProcessBudget(limits))
        self._handler = handler
        self._admission = admission
        self._admitted = False
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self._buf = bytearray()
        self._buf_held = 0
        """len(_buf) + len(_block), as counted in the process budget."""
        self._preface_seen = False
        self._closed = False
        self._header_lists = HeaderLists(limits.max_header_list, self._budget.memory)
        self._block = bytearray()
        """A header block still waiting for its CONTINUATION frames."""
        self._block_stream = 0
        self._block_end_stream = False
        self._block_frames = 0
        self._block_error: ProtocolError | None = None
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        """The handshake deadline, then a stalled writer's, then a close's."""
        self._pending_out: list[bytes] | None = None
        """Writes held until the end of the read under way."""
        self._backlog = False
        self._write_paused = False
        self._reading_paused = False

    # ---- asyncio.Protocol --------------------------------------------------------

    def accept(self, transport: Any) -> bool:
        """Names the peer and asks the server's admission; False: refused
        (the caller aborts). A TLS connection is accepted before its
        handshake, so it counts from the first moment it holds a socket."""
        peer = transport.get_extra_info("peername")
        if peer:
            host = f"[{peer[0]}]" if ":" in peer[0] else peer[0]
            self.peer = f"ipv{6 if ':' in peer[0] else 4}:{host}:{peer[1]}"
            self.host = self._header_lists.host = peer[0]
        self._admitted = self._admission is None or self._admission.admit(self)
        return self._admitted

    def connection_made(self, transport: Any) -> None:
        if not self._admitted and not self.accept(transport):
            self._closed = True
            transport.abort()
            return
        self.transport = transport
        lim = self._limits
        with_settings = (
            (SETTINGS_MAX_CONCURRENT_STREAMS, lim.max_streams),
            (SETTINGS_INITIAL_WINDOW_SIZE, lim.stream_window),
            (SETTINGS_MAX_FRAME_SIZE, lim.max_frame),
            (SETTINGS_MAX_HEADER_LIST_SIZE, lim.max_header_list),
        )
        self._credit = lim.connection_window
        transport.write(
            frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in with_settings))
            + frame(WINDOW_UPDATE, 0, 0, U32.pack(lim.connection_window - DEFAULT_WINDOW))
        )
        transport.set_write_buffer_limits(high=lim.write_high, low=lim.write_low)
        self._timer = asyncio.get_event_loop().call_later(lim.handshake_s, self._handshake_overdue)
        if self._buf:  # TLS: what came with the end of the handshake
            self._process()

    def _handshake_overdue(self) -> None:
        if not self._preface_seen and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._closed = True
        streams = list(self._streams)
        for stream_id in streams:
            self._forget(stream_id)
        self.transport = None
        self._budget.held.release(self.host, self._buf_held)
        self._buf_held = 0
        self._buf = bytearray()
        self._block = bytearray()
        self._header_lists.clear()
        for stream_id in streams:
            self._handler.on_closed(self, stream_id)
        if self._admission is not None:
            self._admission.lost(self)

    def pause_writing(self) -> None:
        """The peer does not take our answers: read no more from it."""
        self._write_paused = True
        if not self._closed:  # a close's abort timer stays
            self._set_timer(self._limits.write_stall_s, self._stalled)
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._timer is not None and not self._closed:
            self._timer.cancel()
        if self._backlog:
            self._resume()
        self._update_reading()

    def _stalled(self) -> None:
        if self._write_paused:
            why = f"no answer taken in {self._limits.write_stall_s:.0f} s"
            self.close(ENHANCE_YOUR_CALM, why)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self.reads += 1
        self._buf += data
        if self.transport is not None:
            self._process()

    def tick(self, now: float) -> None:
        """The server's sweep looks in: answers left unread past
        `write_stall_s` on the peer's windows end the connection, and so
        does a keepalive PING left unanswered (`keepalive`)."""
        if self._closed or self.transport is None:
            return
        stall = self._limits.write_stall_s
        if self.blocked_since is not None and now - self.blocked_since > stall:
            self.close(ENHANCE_YOUR_CALM, f"no answer read in {stall:.0f} s")
        elif not self.keepalive(now):
            _peer_log.log(self.peer, "no answer to a keepalive PING")
            self._closed = True
            self.transport.abort()

    def charge(self, units: int) -> None:
        """Work the handler did for the read under way (a message decompressed)."""
        self._work -= units

    def _resume(self) -> None:
        """The rest of a read that an earlier turn's work budget left."""
        self._backlog = False
        if not self._closed:
            self._process()
            self._update_reading()

    def _process(self) -> None:
        """Frames of the read buffer, within the turn's work budget; a
        broken rule closes the connection, the answers go out in one write."""
        if self._pending_out is None:  # else corked: this read's end sends it
            self._pending_out = []
        turn = self._budget.turn
        given = self._work = min(self._limits.work_per_read, turn.left(self.host))
        buf = self._buf
        pos = 0
        try:
            if not self._preface_seen:
                if not self._preface():
                    return
                pos = len(PREFACE)
            size = len(buf)
            max_frame = self._limits.max_frame
            while size - pos >= 9 and not self._closed:
                if self._work <= 0 or self._write_paused:
                    self._defer()
                    break
                found = frame_at(buf, pos, size, max_frame)
                if found is None:
                    break
                kind, flags, stream_id, payload, pos = found
                self._work -= 1
                try:
                    if kind == DATA and stream_id and not self._block_stream:
                        self._data(flags, stream_id, payload)  # the usual frame, first
                    else:
                        self._frame(kind, flags, stream_id, payload)
                except ProtocolError as e:
                    if not e.stream:
                        raise
                    self._stream_error(e)
        except ProtocolError as e:
            self.close(e.code, str(e))
        except hpack.OversizedHeaderListError as e:
            self.close(ENHANCE_YOUR_CALM, f"a header list over the limit: {e}")
        except hpack.HPACKError as e:
            self.close(COMPRESSION_ERROR, f"header block: {e}")
        finally:
            del buf[:pos]
            self._flush_out()
            turn.spend(self.host, given - self._work)
        held = len(buf) + len(self._block)
        if held != self._buf_held and not self._closed:
            grows = held - self._buf_held
            if grows > 0 and not self._budget.held.take(self.host, grows):
                self.close(ENHANCE_YOUR_CALM, "the server holds too many partial requests")
                return
            if grows < 0:
                self._budget.held.release(self.host, -grows)
            self._buf_held = held

    def _preface(self) -> bool:
        """Whether the client's preface is whole (it is checked as it comes)."""
        buf = self._buf
        if len(buf) < len(PREFACE):
            if not PREFACE.startswith(bytes(buf)):
                raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            return False
        if buf[: len(PREFACE)] != PREFACE:
            raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._preface_seen = True
        if self._timer is not None:
            self._timer.cancel()
        return True

    def _defer(self) -> None:
        """Leaves the rest of the read for a later turn: the next one if the
        work budget ran out, `resume_writing` if the peer takes no answers."""
        if not self._backlog:
            self._backlog = True
            if not self._write_paused:
                asyncio.get_event_loop().call_soon(self._resume)
            self._update_reading()

    def _update_reading(self) -> None:
        paused = self._backlog or self._write_paused
        if paused != self._reading_paused and self.transport is not None and not self._closed:
            self._reading_paused = paused
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _flush_out(self) -> None:
        out, self._pending_out = self._pending_out, None
        if out and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # ---- frames in ----------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block_stream and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "a frame inside a header block")
        if kind > HEADERS or not stream_id:  # DATA and HEADERS on a stream pass
            check_frame(kind, flags, stream_id, len(payload))
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if not flags & ACK:
                self._ping(payload)
        elif kind == RST_STREAM:
            self._peer_reset(stream_id)
        elif kind == PRIORITY:
            self._priority(stream_id, payload)
        elif kind == GOAWAY:
            self._closing = True
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # Unknown types are ignored, as the RFC asks.

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id % 2:
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on even stream {stream_id}")
        self._block_error = None
        try:
            fragment = header_fragment(flags, stream_id, payload)
        except ProtocolError as e:
            if not e.stream:
                raise
            # Still decoded (the HPACK table is shared), then the stream refused.
            self._block_error = e
            fragment = unpad(flags, payload)[5:]
        if len(fragment) > self._limits.max_header_block:
            raise ProtocolError(ENHANCE_YOUR_CALM, "a header block over the limit")
        self._block[:] = fragment
        self._block_stream = stream_id
        self._block_end_stream = bool(flags & END_STREAM)
        self._block_frames = 0
        if flags & END_HEADERS:
            self._header_block_done()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != self._block_stream:
            raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self._block_frames += 1
        if self._block_frames > self._limits.max_continuations:
            raise ProtocolError(ENHANCE_YOUR_CALM, "a header block in too many frames")
        if len(self._block) + len(payload) > self._limits.max_header_block:
            raise ProtocolError(ENHANCE_YOUR_CALM, "a header block over the limit")
        self._block += payload
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        stream_id, end_stream = self._block_stream, self._block_end_stream
        self._block_stream = 0
        lists = self._header_lists
        headers = lists.decode(bytes(self._block))
        self._work -= lists.work
        self._block.clear()
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers: gRPC clients send none
            if not end_stream:
                raise ProtocolError(PROTOCOL_ERROR, "a second header block", stream_id)
            if stream.remote_done:
                raise ProtocolError(STREAM_CLOSED, "headers after the end", stream_id)
            stream.remote_done = True
            self._handler.on_data(self, stream_id, b"", True)
            return
        if stream_id <= self._last_stream:
            if end_stream and stream_id not in self._reset_by_peer:
                # Trailers of a call answered already: decoded for the shared
                # table, dropped, and charged as a call; a gRPC client sends none.
                self._work -= _NEW_STREAM_WORK
                if not self._rates.answered_headers.take():
                    self._calm("answered_headers", "too many header blocks on answered streams")
                return
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS opening old stream {stream_id}")
        self._last_stream = stream_id
        self._work -= _NEW_STREAM_WORK
        if self._block_error is not None:
            raise self._block_error
        if headers is MALFORMED:
            raise ProtocolError(PROTOCOL_ERROR, "a malformed request header list", stream_id)
        lim = self._limits
        if (
            self._closing
            or len(self._streams) >= lim.max_streams
            or self._unsent > lim.write_high
            or self._budget.memory.over(self.host)
        ):
            self._refuse(stream_id, REFUSED_STREAM)
            return
        stream = Stream(stream_id, self._peer_initial_window, lim.stream_window, end_stream)
        self._streams[stream_id] = stream
        self.idle_since = None
        self._handler.on_headers(self, stream_id, headers)
        if end_stream and stream_id in self._streams:
            self._handler.on_data(self, stream_id, b"", True)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        length = len(payload)
        if not length and not flags & END_STREAM and not self._rates.empty_data.take():
            self._calm("empty_data", "too many empty DATA frames")  # CVE-2019-9518
        if length > self._credit:
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        self._credit -= length
        stream = self._streams.get(stream_id)
        if stream is None:
            self._give_back(None)
            if stream_id > self._last_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            if stream_id in self._reset_by_peer:
                raise ProtocolError(STREAM_CLOSED, "DATA after RST_STREAM", stream_id)
            return  # a stream we closed: its data in flight still arrives; dropped
        data = unpad(flags, payload) if flags & PADDED else payload
        if stream.remote_done:
            self._give_back(None)
            raise ProtocolError(STREAM_CLOSED, "DATA after the end of the stream", stream_id)
        if length > stream.credit:
            self._give_back(None)
            raise ProtocolError(FLOW_CONTROL_ERROR, "DATA past the stream's window", stream_id)
        stream.credit -= length
        size = len(data)
        if size:
            if not self._budget.held.take(self.host, size):
                self._give_back(None)
                raise ProtocolError(ENHANCE_YOUR_CALM, "the server holds too much", stream_id)
            self._work -= size >> 12  # copied on: charged by the 4 KiB
            stream.held += size
            self._held += size
        end = stream.remote_done = bool(flags & END_STREAM)
        if length != size:
            if not size and not end and not self._rates.empty_data.take():
                self._calm("empty_data", "too many DATA frames of padding only")
            self._give_back(stream)  # the padding is consumed now
        self._handler.on_data(self, stream_id, data, end)

    def _stream_error(self, e: ProtocolError) -> None:
        if e.stream in self._streams:
            self._forget(e.stream)
            self._handler.on_closed(self, e.stream)
        self._refuse(e.stream, e.code)

    def _write(self, data: bytes) -> None:
        """Writes now, or at the end of the read under way: what one read
        asks for (answers, acks, window updates) goes out in one send."""
        if self._pending_out is not None:
            self._pending_out.append(data)
        elif self.transport is not None:
            if corking.cork(self._flush_out):
                self._pending_out = [data]
            else:
                self.transport.write(data)

    def goaway(self) -> None:
        """Refuses new streams; those open run on (graceful shutdown)."""
        if not self._closing:
            self._closing = True
            self._write(frame(GOAWAY, 0, 0, U32.pack(self._last_stream) + U32.pack(NO_ERROR)))

    def evict(self) -> None:
        """Closed at once to make room for another: GOAWAY if the socket
        takes it now, then the socket goes, with no `close_s` to linger."""
        transport = self.transport
        self.close()
        if transport is not None:
            transport.abort()

    def close(self, code: int = NO_ERROR, why: str = "") -> None:
        """GOAWAY with `code` and closes; the handler hears of every open
        stream. A peer that does not take the GOAWAY is cut off after
        `close_s`; one told to calm down (a flood, a bound passed) at once,
        with what the socket took of the GOAWAY."""
        if self.transport is None or self._closed:
            return
        if code != NO_ERROR:
            _peer_log.log(self.peer, why)
        self._write(frame(GOAWAY, 0, 0, U32.pack(self._last_stream) + U32.pack(code)))
        self._flush_out()
        self._closed = True
        self._block = bytearray()
        if code == ENHANCE_YOUR_CALM:
            self.transport.abort()
            return
        self.transport.close()
        self._set_timer(self._limits.close_s, self.transport.abort)

    def _set_timer(self, delay: float, callback: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_event_loop().call_later(delay, callback)
