"""Our HTTP/2 client connection (RFC 9113) on an asyncio Protocol: what
lighthouse.rpc.lean's client sends its gRPC calls over (their bytes are
lighthouse.rpc.lean.client_calls's; nothing of gRPC here).

Only what calls to a known server need: the client preface, SETTINGS, PING,
flow control both ways, GOAWAY and RST_STREAM; HPACK decoding by the
`hpack` library, our headers sent as literals.

The server is not trusted: what it can make a connection hold is bounded
(frames of MAX_FRAME bytes, header blocks of MAX_HEADER_BLOCK before
decoding and MAX_HEADER_LIST after, what each stream holds by its
ClientStream, windows given back as the stream takes its bytes,
MAX_WRITE_BUFFER of our answers unread), and so is the work it can make
us do: frames that do nothing for a call (PRIORITY, empty DATA or
CONTINUATION, SETTINGS, PINGs, resets and window updates past what our
calls explain) have rates per connection, as our server's do
(lighthouse.rpc.h2.limits). A broken rule of RFC 9113, or a rate passed,
aborts the connection (GOAWAY with the RFC's error code, or
ENHANCE_YOUR_CALM), and its streams fail with `Unavailable`.

Time is bounded too: a connection with calls open that hears nothing for
KEEPALIVE_S is PINGed, and aborted without an answer (a server gone
without FIN); one the server sent GOAWAY on is closed once its last call
ends (a server that never closes it would cost us a socket per step).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import hpack

from lighthouse.rpc.h2.frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    ERROR_NAMES,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    WINDOW_UPDATE,
    ProtocolError,
    check_frame,
    frame,
    frame_at,
    header_fragment,
    settings,
    unpad,
    window_increment,
)
from lighthouse.rpc.h2.limits import TokenBucket

_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
MAX_FRAME = DEFAULT_MAX_FRAME
"""The largest frame we accept: we advertise no SETTINGS_MAX_FRAME_SIZE, so
RFC 9113's initial value; a larger one is a FRAME_SIZE_ERROR."""
MAX_HEADER_BLOCK = 16 * 1024
"""Bytes of one header block as sent (HEADERS and CONTINUATIONs), checked
before it is decoded."""
MAX_HEADER_LIST = 16 * 1024
"""Bytes of one decoded header list, counted as RFC 9113 6.5.2 does (hpack's
max_header_list_size); grpcio's hard limit on received metadata."""
MAX_HELD = 5 + 4 * 1024 * 1024
"""The most a stream of ours holds at once: our calls hold one message of
gRPC's default 4 MiB limit and its 5-byte prefix (lean.client_calls)."""
RECV_WINDOW = 2 * MAX_HELD
"""What the server may send us, per stream and on the connection, before our
WINDOW_UPDATE. Given back as streams take their bytes, once half of it is:
the most a stream holds always fits in what is left, so no answer waits on
flow control."""
_REFRESH = RECV_WINDOW // 2
_PADDED_OR_PRIORITY = PADDED | PRIORITY_FLAG
MAX_WRITE_BUFFER = 1024 * 1024
"""Bytes of ours waiting to go out past which the connection is aborted: a
server that asks for answers (PINGs, SETTINGS) and reads none of them."""
MAX_UNSENT = 65_536
"""Bytes of a stream's messages the socket may hold back before a send
fails: a server that takes none of them is as good as gone."""
CACHED_BLOCKS = 16
"""Decoded header blocks a connection keeps (ClientConnection._decode)."""
MAX_CONTINUATIONS = 64
"""CONTINUATION frames in one header block, as our server allows."""
MAX_SETTINGS = 64
"""Entries in one SETTINGS frame (RFC 9113 defines six; 16 KiB holds 2,730)."""
NO_WORK_RATE = (1024.0, 256.0)
"""Frames that do nothing for a call (PRIORITY, empty DATA without
END_STREAM, empty CONTINUATION, unknown types, acks we did not ask for,
HEADERS or RST_STREAM on ended calls, GOAWAY after the first, window
updates past UPDATES_PER_SEND): a burst, then so many a second. A server
sends these rarely (an answer crossing our reset), a flood keeps our loop
busy."""
SETTINGS_RATE = (32.0, 4.0)
"""SETTINGS frames: a burst, then so many a second (our server's rate)."""
PING_RATE = (256.0, 64.0)
"""The server's PINGs: a burst, then so many a second. Generous: servers
probe bandwidth with PINGs as answers flow (C-core's BDP estimator)."""
UPDATES_PER_SEND = 2
"""WINDOW_UPDATEs a stream id we opened or DATA frame we sent explains (the
stream's and the connection's), beyond UPDATE_SLACK; past them they are
no-work frames."""
UPDATE_SLACK = 64
KEEPALIVE_S = 10.0
"""With calls open, a connection that heard nothing from the server within
one to two of these is sent a PING (checked on a timer, not per read)."""
PING_TIMEOUT_S = 5.0
"""... and aborted if nothing comes back within this: the server is gone
without a FIN (a partition), and the calls would wait out their deadlines."""
_KEEPALIVE_PING = b"keepaliv"


class Unavailable(Exception):
    """The call could not be made (or finished) on this connection: make it another way."""


class ClientStream:
    """One stream of ours: what the connection needs of the call it carries
    (lighthouse.rpc.lean.client_calls says what the bytes mean)."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] = []
        """The response's headers, once they came (trailers go to `finish`)."""
        self.body = bytearray()
        """What of the stream's DATA it holds; counted against our window."""
        self.unacked = 0
        """Bytes of its window taken and not yet given back."""
        self.window = DEFAULT_WINDOW
        """What we may still send on it (the server's window for the stream)."""

    def take(self, payload: bytes) -> bool:
        """DATA's bytes. False: the call failed, and its stream is to be reset."""
        raise NotImplementedError

    def finish(self, trailers: list[tuple[str, str]]) -> None:
        """The server ended the stream, with these trailers."""
        raise NotImplementedError

    def fail(self, error: Exception) -> None:
        """The stream ended otherwise: reset, lost, or failed on our side."""
        raise NotImplementedError


class ClientConnection(asyncio.Protocol):
    """One client connection; streams are our calls in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        self._block = bytearray()
        self._block_stream = 0
        """The stream of a header block still waiting for CONTINUATIONs (0: none)."""
        self._block_end = False
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}
        self.calls: dict[int, ClientStream] = {}
        self._next_stream = 1
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = 16_384
        self._recv_unacked = 0
        """Bytes of the connection's window taken or dropped and not yet given back."""
        self.closing = False
        """No new calls: lost, aborted, or the server sent GOAWAY (then
        closed by us once `calls` is empty)."""
        self._block_frames = 0
        self._no_work = TokenBucket(NO_WORK_RATE)
        self._settings_rate = TokenBucket(SETTINGS_RATE)
        self._ping_rate = TokenBucket(PING_RATE)
        self._updates = 0
        """WINDOW_UPDATEs received (UPDATES_PER_SEND)."""
        self._data_frames = 0
        """DATA frames sent by `send` (requests count by stream id)."""
        self._reads = 0
        """Reads from the server: the keepalive timer checks it moved."""
        self._reads_seen = 0
        self._pinged = False
        """Our keepalive PING waits for its ACK: that one is no flood."""
        self._keepalive: asyncio.TimerHandle | None = None
        """The keepalive's timer while calls are open; None when idle."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        ours = (
            (SETTINGS_ENABLE_PUSH, 0),
            (SETTINGS_INITIAL_WINDOW_SIZE, RECV_WINDOW),
            (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
        )
        transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in ours))
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - DEFAULT_WINDOW))
        )
        transport.set_write_buffer_limits(high=MAX_WRITE_BUFFER)

    def pause_writing(self) -> None:
        """Over MAX_WRITE_BUFFER bytes of ours wait to go out: the server
        reads nothing, and may be asking for answers it never takes."""
        self.abort(f"over {MAX_WRITE_BUFFER} bytes not taken by the server")

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport, self.closing = None, True
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.fail(Unavailable(f"connection lost: {exc or 'closed by the server'}"))

    def data_received(self, data: bytes) -> None:
        self._reads += 1
        buf = self._buf
        buf += data
        pos, size, out = 0, len(buf), list[bytes]()
        try:
            while size - pos >= 9:
                found = frame_at(buf, pos, size, MAX_FRAME)
                if found is None:
                    break
                kind, flags, stream_id, payload, pos = found
                self._frame(kind, flags, stream_id, payload, out)
        except ProtocolError as e:
            self._broken(e.code, str(e))
            return
        except hpack.HPACKError as e:
            self._broken(COMPRESSION_ERROR, f"a header block: {e}")
            return
        except Exception as e:  # a check we lack: still the connection's end, not the loop's
            self._broken(INTERNAL_ERROR, f"a frame not understood: {e!r}")
            return
        del buf[:pos]
        if self._recv_unacked >= _REFRESH:
            out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        if out and self.transport is not None:
            self.transport.write(b"".join(out))
        if self.closing and not self.calls:
            self._drained()

    def _frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes, out: list[bytes]
    ) -> None:
        if self._block_stream and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, f"a frame of type {kind} inside a header block")
        if kind == DATA:
            self._data(flags, stream_id, payload, out)
        elif kind == HEADERS:
            if flags & _PADDED_OR_PRIORITY:
                payload = header_fragment(flags, stream_id, payload)
            if len(payload) > MAX_HEADER_BLOCK:
                raise ProtocolError(ENHANCE_YOUR_CALM, "a header block over the limit")
            self._block[:] = payload
            self._block_stream, self._block_end = stream_id, bool(flags & END_STREAM)
            if flags & END_HEADERS:
                self._headers_done()
            else:
                self._block_frames = 0
        elif kind == CONTINUATION:
            if stream_id != self._block_stream or not stream_id:
                raise ProtocolError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._block_frames += 1
            if self._block_frames > MAX_CONTINUATIONS:
                raise ProtocolError(ENHANCE_YOUR_CALM, "a header block in too many frames")
            if not payload:
                self._idle("empty CONTINUATION frames")
            if len(self._block) + len(payload) > MAX_HEADER_BLOCK:
                raise ProtocolError(ENHANCE_YOUR_CALM, "a header block over the limit")
            self._block += payload
            if flags & END_HEADERS:
                self._headers_done()
        else:
            check_frame(kind, flags, stream_id, len(payload))
            self._control(kind, flags, stream_id, payload, out)

    def _control(
        self, kind: int, flags: int, stream_id: int, payload: bytes, out: list[bytes]
    ) -> None:
        """Frames but DATA and header blocks, their lengths and stream checked."""
        if kind == SETTINGS and not flags & ACK:
            if not self._settings_rate.take():
                raise ProtocolError(ENHANCE_YOUR_CALM, "too many SETTINGS frames")
            if len(payload) > 6 * MAX_SETTINGS:
                raise ProtocolError(ENHANCE_YOUR_CALM, f"over {MAX_SETTINGS} SETTINGS entries")
            window = None
            for key, value in settings(payload):
                if key == SETTINGS_INITIAL_WINDOW_SIZE:
                    window = value  # the last one holds; streams move once
                elif key == SETTINGS_MAX_FRAME_SIZE:
                    self._peer_max_frame = value
            if window is not None:  # every stream's window moves
                for open_call in self.calls.values():
                    open_call.window += window - self._peer_initial_window
                    if open_call.window > MAX_WINDOW:
                        raise ProtocolError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
                self._peer_initial_window = window
            out.append(frame(SETTINGS, ACK, 0, b""))
        elif kind == PING and not flags & ACK:
            if not self._ping_rate.take():
                raise ProtocolError(ENHANCE_YOUR_CALM, "too many PINGs")
            out.append(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._updates += 1
            explained = self._next_stream + UPDATES_PER_SEND * self._data_frames + UPDATE_SLACK
            if self._updates > explained:
                self._idle("WINDOW_UPDATE frames past the data we sent")
            increment = window_increment(payload, stream_id)
            if stream_id == 0:
                self._send_window += increment
                window = self._send_window
            elif (stream := self.calls.get(stream_id)) is not None:
                stream.window += increment
                window = stream.window
            else:
                return
            if window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "a window over 2^31-1")
        elif kind == RST_STREAM:
            if not stream_id % 2 or stream_id >= self._next_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on stream {stream_id}, not ours")
            call = self._forget(stream_id)
            if call is None:
                self._idle("RST_STREAM frames on ended calls")
            else:
                (code,) = _U32.unpack(payload)
                call.fail(Unavailable(f"the server reset the call (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            if self.closing:
                self._idle("GOAWAY frames")
            self.closing = True
            last = _U32.unpack_from(payload)[0] & MAX_WINDOW
            for sid in [s for s in self.calls if s > last]:
                call = self._forget(sid)
                if call is not None:
                    call.fail(Unavailable("the server is going away"))
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE, though we disabled push")
        elif kind == PING and self._pinged and payload == _KEEPALIVE_PING:
            self._pinged = False  # our keepalive's answer (its read counted: data_received)
        else:  # PRIORITY, acks we did not ask for (but SETTINGS's first), unknown types
            self._idle(f"frames of type {kind} that do nothing")

    def _headers_done(self) -> None:
        stream_id, self._block_stream = self._block_stream, 0
        headers = self._decode(bytes(self._block))
        call = self.calls.get(stream_id)
        if call is None:
            if not stream_id % 2 or stream_id >= self._next_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, not ours")
            self._idle("HEADERS frames on ended calls")
            return
        if not self._block_end:
            call.headers = headers
            return
        del self.calls[stream_id]
        self._recv_unacked += len(call.body)  # what it held comes back
        call.finish(headers)

    def _idle(self, what: str) -> None:
        """A frame that did no work: past NO_WORK_RATE, the connection ends."""
        if not self._no_work.take():
            raise ProtocolError(ENHANCE_YOUR_CALM, f"too many {what}")

    def _drained(self) -> None:
        """After the server's GOAWAY, the connection is closed by us once no
        call is left on it (checked after each read and `cancel`): a server
        may never close it itself."""
        transport = self.transport
        if transport is not None:
            if transport.get_write_buffer_size():
                transport.abort()  # what is left would only keep the socket
            else:
                transport.close()

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """Every block is decoded in order (the table is shared state), but
        for one seen before while the table was and stayed empty, and not
        resizing it: its fields then depend on nothing else (our server's
        answers, all literals, every step)."""
        table = self._decoder.header_table.dynamic_entries
        cacheable = not table and block[:1] and block[0] & 0xE0 != 0x20  # 001xxxxx: resizes
        if cacheable and block in self._decoded:
            return self._decoded[block]
        headers = [(str(k), str(v)) for k, v in self._decoder.decode(block, raw=False)]
        if cacheable and not table and len(self._decoded) < CACHED_BLOCKS:
            self._decoded[block] = headers
        return headers

    def _data(self, flags: int, stream_id: int, payload: bytes, out: list[bytes]) -> None:
        """A call's bytes. What of the windows they take comes back as the
        call takes messages (padding and dropped bytes at once), not as
        they arrive: a call holds at most one message, so the server can
        make us hold no more than that per call."""
        size = len(payload)
        if not size and not flags & END_STREAM:
            self._idle("empty DATA frames")
        if flags & PADDED:
            payload = unpad(flags, payload)
        call = self.calls.get(stream_id)
        if call is None:
            if not stream_id % 2 or stream_id >= self._next_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on stream {stream_id}, not ours")
            self._recv_unacked += size  # a call that has ended: dropped
            return
        held = len(call.body)
        kept = call.take(payload)
        given = held + size - len(call.body)  # padding, and the messages taken
        self._recv_unacked += given
        if not kept:  # the call failed (a message too large): the others go on
            self._forget(stream_id)
            out.append(frame(RST_STREAM, 0, stream_id, _U32.pack(CANCEL)))
        elif given:
            call.unacked += given
            if call.unacked >= _REFRESH and not flags & END_STREAM:
                out.append(frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(call.unacked)))
                call.unacked = 0

    def _forget(self, stream_id: int) -> ClientStream | None:
        """Takes a call out of the table; what it held of the window comes back."""
        call = self.calls.pop(stream_id, None)
        if call is not None:
            self._recv_unacked += len(call.body)
        return call

    def _broken(self, code: int, why: str) -> None:
        """The server broke the protocol: GOAWAY with `code`, and abort."""
        if self.transport is not None:
            detail = _U32.pack(0) + _U32.pack(code) + why.encode()[:256]
            self.transport.write(frame(GOAWAY, 0, 0, detail))
        self.abort(f"the server broke HTTP/2 ({ERROR_NAMES.get(code, code)}): {why}")

    def request(self, headers: bytes, body: bytes, stream: ClientStream) -> int:
        """Sends one request whole, headers and body, on a new stream that
        `stream` takes the answer of; returns its id. Raises Unavailable
        if it cannot go."""
        if self.transport is None or self.closing or self._next_stream > 0x7FFFFFFF:
            raise Unavailable("no open connection")
        if len(body) > min(self._send_window, self._peer_initial_window, self._peer_max_frame):
            raise Unavailable("a request larger than the server's window or frame size")
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        stream.window = self._peer_initial_window - len(body)
        self.calls[stream_id] = stream
        self._send_window -= len(body)
        if self._keepalive is None:
            self._arm(KEEPALIVE_S, self._keepalive_due)
        self.transport.write(
            frame(HEADERS, END_HEADERS, stream_id, headers)
            + frame(DATA, END_STREAM, stream_id, body)
        )
        return stream_id

    def open(self, headers: bytes, stream: ClientStream) -> int:
        """Opens a stream (its headers only) that `stream` carries; returns
        its id. Raises Unavailable if it cannot."""
        if self.transport is None or self.closing or self._next_stream > 0x7FFFFFFF:
            raise Unavailable("no open connection")
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        stream.window = self._peer_initial_window
        self.calls[stream_id] = stream
        if self._keepalive is None:
            self._arm(KEEPALIVE_S, self._keepalive_due)
        self.transport.write(frame(HEADERS, END_HEADERS, stream_id, headers))
        return stream_id

    def send(self, stream_id: int, stream: ClientStream, body: bytes) -> None:
        """DATA on an open stream; raises Unavailable if it cannot go now
        (no window, or a server that has not read what we sent)."""
        if self.transport is None or self.calls.get(stream_id) is not stream:
            raise Unavailable("the stream is closed")
        if self.transport.get_write_buffer_size() > MAX_UNSENT:
            raise Unavailable(f"over {MAX_UNSENT} bytes not taken by the server")
        if len(body) > min(self._send_window, stream.window, self._peer_max_frame):
            raise Unavailable("a message larger than the server's window or frame size")
        self._send_window -= len(body)
        stream.window -= len(body)
        self._data_frames += 1
        self.transport.write(frame(DATA, 0, stream_id, body))

    def _arm(self, delay: float, then: Any) -> None:
        """The keepalive's next check, `delay` from now; what it has heard
        counts from here."""
        self._reads_seen = self._reads
        self._keepalive = asyncio.get_running_loop().call_later(delay, then)

    def _keepalive_due(self) -> None:
        """KEEPALIVE_S since the last check: heard from the server since, or
        no call open, nothing to do (and, idle, no timer until the next
        call); else a PING, which PING_TIMEOUT_S must see answered."""
        self._keepalive = None
        if self.transport is None or not self.calls:
            return
        if self._reads != self._reads_seen:
            self._arm(KEEPALIVE_S, self._keepalive_due)
            return
        self.transport.write(frame(PING, 0, 0, _KEEPALIVE_PING))
        self._pinged = True
        self._arm(PING_TIMEOUT_S, self._ping_due)

    def _ping_due(self) -> None:
        self._keepalive = None
        if self.transport is None:
            return
        if self._reads == self._reads_seen:
            self.abort(
                f"nothing from the server within {PING_TIMEOUT_S:g} s of our PING, "
                f"after {KEEPALIVE_S:g} s of silence"
            )
        elif self.calls:
            self._arm(KEEPALIVE_S, self._keepalive_due)

    def cancel(self, stream_id: int) -> None:
        if self._forget(stream_id) is not None and self.transport is not None:
            out = frame(RST_STREAM, 0, stream_id, _U32.pack(CANCEL))
            if self._recv_unacked >= _REFRESH:
                out += frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked))
                self._recv_unacked = 0
            self.transport.write(out)
            if self.closing and not self.calls:
                self._drained()

    def abort(self, why: str) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(Unavailable(why))
