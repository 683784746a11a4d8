"""The server side of one HTTP/2 connection (RFC 9113) on an asyncio Protocol.

Just what a gRPC server needs: framing, HPACK decoding (the `hpack`
library), both directions' flow control, SETTINGS, PING, RST_STREAM and
GOAWAY. Requests go to a `StreamHandler` as decoded headers and data;
answers are written with `send_headers`, `send_data` and `reset`.

Why not grpcio's server: a unary call costs it ~600 us of CPU on this
box whatever the handler does (thread hand-offs between its poller and the
event loop, ~18 syscalls a call; bench/NOTES.md). Here a call is one
`data_received` and one `write` on the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any, Protocol

import hpack

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB

_HEADER = struct.Struct(">BHBBI")
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535

RECV_WINDOW = 4 * 1024 * 1024
"""What each stream, and the connection, may send us before our WINDOW_UPDATE:
large, so that no call of ours waits on flow control; refreshed at half."""
MAX_CONCURRENT_STREAMS = 1000
MAX_FRAME_SIZE = 1 << 20
"""The largest frame we accept (SETTINGS_MAX_FRAME_SIZE): one frame per
message up to a megabyte."""
_INDEXED = bytes(range(0x80, 0xFF))
"""First bytes of an indexed header field with a one-byte index (RFC 7541 6.1)."""
_CACHED_BLOCKS = 64
HANDSHAKE_TIMEOUT_S = 10.0
"""A connection that has not sent the HTTP/2 preface by then (a port scan, a
stray HTTP/1 client) is dropped."""


class ConnectionError_(Exception):
    """A connection error: the peer broke the protocol; GOAWAY and close."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class StreamHandler(Protocol):
    """What a connection calls, on the loop's thread, for each stream's events."""

    def on_headers(self, conn: Connection, stream_id: int, headers: list[tuple[str, str]]) -> None:
        """A new request's headers (the stream is open; refuse with `reset`)."""

    def on_data(self, conn: Connection, stream_id: int, data: bytes, end: bool) -> None:
        """Body bytes of an open stream; `end`: the peer sent its last."""

    def on_closed(self, conn: Connection, stream_id: int) -> None:
        """The stream ended abnormally: RST_STREAM, or the connection is gone."""


class _Outgoing:
    """A stream's send side: its flow-control window and what waits on it."""

    __slots__ = ("window", "pending", "end_after")

    def __init__(self, window: int) -> None:
        self.window = window
        self.pending = bytearray()
        self.end_after: bytes | None = None
        """A header block (trailers) to send with END_STREAM once pending is out."""


class Connection(asyncio.Protocol):
    """One client connection. Streams are ids the handler owns; this class
    only keeps their flow-control windows."""

    def __init__(self, handler: StreamHandler, on_lost: Any = None) -> None:
        self._handler = handler
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self._buf = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder()
        self._decoded: dict[bytes, list[tuple[str, str]]] = {}
        """Header blocks of indexed fields only -> their headers, while the
        table is unchanged: a client's repeated call sends the same few bytes."""
        self._block = bytearray()
        """A header block still waiting for its CONTINUATION frames."""
        self._block_stream = 0
        self._block_end_stream = False
        self._streams: dict[int, _Outgoing] = {}
        self._last_stream = 0
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = 16_384
        self._recv_unacked = 0
        """Bytes received on the connection since our last WINDOW_UPDATE for it."""
        self._stream_unacked: dict[int, int] = {}
        self._blocked: set[int] = set()
        """Open streams with data waiting on flow control."""
        self._closing = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._pending_out: list[bytes] | None = None
        """Writes held until the end of the `data_received` under way."""

    # ---- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            host = f"[{peer[0]}]" if ":" in peer[0] else peer[0]
            self.peer = f"ipv{6 if ':' in peer[0] else 4}:{host}:{peer[1]}"
        settings = b"".join(
            _SETTING.pack(k, v)
            for k, v in ((0x3, MAX_CONCURRENT_STREAMS), (0x4, RECV_WINDOW), (0x5, MAX_FRAME_SIZE))
        )
        transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(RECV_WINDOW - DEFAULT_WINDOW))
        )
        self._handshake_timer = asyncio.get_event_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._handshake_overdue
        )

    def _handshake_overdue(self) -> None:
        if not self._preface_seen and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        streams, self._streams = self._streams, {}
        self.transport = None
        for stream_id in streams:
            self._handler.on_closed(self, stream_id)
        if self._on_lost is not None:
            self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        self._pending_out = []
        try:
            pos = 0
            if not self._preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._preface_seen = True
                pos = len(PREFACE)
            size = len(buf)
            while size - pos >= 9 and self.transport is not None:
                hi, lo, kind, flags, stream_id = _HEADER.unpack_from(buf, pos)
                length = hi << 16 | lo
                if length > MAX_FRAME_SIZE:
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > size:
                    break
                self._frame(kind, flags, stream_id & _MAX_WINDOW, bytes(buf[pos + 9 : end]))
                pos = end
            del buf[:pos]
        except ConnectionError_ as e:
            self._flush_out()
            self.close(e.code, str(e))
        except hpack.HPACKError as e:
            self._flush_out()
            self.close(COMPRESSION_ERROR, f"header block: {e}")
        finally:
            self._flush_out()

    def _flush_out(self) -> None:
        out, self._pending_out = self._pending_out, None
        if out and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # ---- frames in ----------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block_stream and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a frame inside a header block")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if stream_id != self._block_stream or not stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
            self._block += payload
            if flags & END_HEADERS:
                self._header_block_done()
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._forget(stream_id)
            self._handler.on_closed(self, stream_id)
        elif kind == GOAWAY:
            self._closing = True
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        # PRIORITY and unknown types are ignored, as the RFC asks.

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id % 2:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on even stream {stream_id}")
        start, stop = 0, len(payload)
        if flags & PADDED:
            start, stop = 1, stop - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        self._block[:] = payload[start:stop]
        self._block_stream = stream_id
        self._block_end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        stream_id, end_stream = self._block_stream, self._block_end_stream
        self._block_stream = 0
        headers = self._decode(bytes(self._block))
        if stream_id in self._streams:  # trailers: gRPC clients send none
            if end_stream:
                self._handler.on_data(self, stream_id, b"", True)
            return
        if stream_id <= self._last_stream:
            raise ConnectionError_(PROTOCOL_ERROR, f"stream {stream_id} reused")
        self._last_stream = stream_id
        if self._closing:
            self._write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        if len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        self._streams[stream_id] = _Outgoing(self._peer_initial_window)
        self._handler.on_headers(self, stream_id, headers)
        if end_stream and stream_id in self._streams:
            self._handler.on_data(self, stream_id, b"", True)

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """Decodes every block (a block may change the table), except one
        of indexed fields already decoded since the table last changed:
        such a block neither changes the table nor means anything else."""
        if block.translate(None, _INDEXED):
            self._decoded.clear()  # it may have changed the table
            return list(self._decoder.decode(block, raw=False))  # type: ignore[arg-type]
        headers = self._decoded.get(block)
        if headers is None:
            headers = list(self._decoder.decode(block, raw=False))  # type: ignore[arg-type]
            if len(self._decoded) < _CACHED_BLOCKS:
                self._decoded[block] = headers
        return headers

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        if flags & PADDED and size:
            payload = payload[1 : size - payload[0]]
        self._recv_unacked += size
        updates = b""
        if self._recv_unacked >= RECV_WINDOW // 2:
            updates = frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked))
            self._recv_unacked = 0
        end = bool(flags & END_STREAM)
        if stream_id in self._streams:
            if not end:  # a stream that goes on: refresh its window too
                unacked = self._stream_unacked.get(stream_id, 0) + size
                if unacked >= RECV_WINDOW // 2:
                    updates += frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(unacked))
                    unacked = 0
                self._stream_unacked[stream_id] = unacked
            if updates:
                self._write(updates)
            self._handler.on_data(self, stream_id, payload, end)
        else:
            if updates:
                self._write(updates)
            if stream_id > self._last_stream or not stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            # A stream we reset: its data in flight still arrives; dropped.

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS frame of odd length")
        for pos in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, pos)
            if key == 0x4:
                if value > _MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta, self._peer_initial_window = value - self._peer_initial_window, value
                for out in self._streams.values():
                    out.window += delta
            elif key == 0x5:
                if not 16_384 <= value < 1 << 24:
                    raise ConnectionError_(PROTOCOL_ERROR, f"max frame size {value}")
                self._peer_max_frame = value
        self._write(frame(SETTINGS, ACK, 0, b""))
        self._flush_pending()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = _U32.unpack(payload)[0] & _MAX_WINDOW
        if stream_id == 0:
            self._send_window += increment
        elif stream_id in self._streams:
            self._streams[stream_id].window += increment
        self._flush_pending()

    # ---- frames out ---------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Writes now, or at the end of the `data_received` under way: what
        one read asks for (answers, PING and SETTINGS acks, window updates)
        goes out in one send."""
        if self._pending_out is not None:
            self._pending_out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

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
        if out is None or self.transport is None:
            return
        chunks = []
        if headers is not None:
            chunks.append(frame(HEADERS, END_HEADERS, stream_id, headers))
        if out.pending or out.end_after is not None:
            out.pending += data
        elif data:
            sent = self._data_frames(stream_id, out, data, chunks)
            out.pending += data[sent:]
        if out.pending:
            self._blocked.add(stream_id)
        if trailers is not None:
            if out.pending:
                out.end_after = trailers
            else:
                chunks.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, trailers))
                self._forget(stream_id)
        if chunks:
            self._write(b"".join(chunks))

    def _data_frames(self, stream_id: int, out: _Outgoing, data: bytes, chunks: list[bytes]) -> int:
        """Appends DATA frames of `data` that the windows allow; returns bytes framed."""
        allowed = min(len(data), out.window, self._send_window)
        if allowed <= 0:
            return 0
        step = self._peer_max_frame
        for pos in range(0, allowed, step):
            piece = data[pos : min(pos + step, allowed)]
            chunks.append(frame(DATA, 0, stream_id, piece))
        out.window -= allowed
        self._send_window -= allowed
        return allowed

    def _flush_pending(self) -> None:
        """Sends what waited on flow control, as the windows now allow."""
        if not self._blocked:
            return  # the usual case, on each of a client's WINDOW_UPDATEs
        chunks: list[bytes] = []
        for stream_id in list(self._blocked):
            out = self._streams[stream_id]
            data = bytes(out.pending)
            sent = self._data_frames(stream_id, out, data, chunks)
            del out.pending[:sent]
            if not out.pending:
                self._blocked.discard(stream_id)
                if out.end_after is not None:
                    chunks.append(
                        frame(HEADERS, END_HEADERS | END_STREAM, stream_id, out.end_after)
                    )
                    self._forget(stream_id)
        if chunks:
            self._write(b"".join(chunks))

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        """Ends a stream at once (RST_STREAM); nothing more is sent on it."""
        if stream_id in self._streams:
            self._forget(stream_id)
            self._write(frame(RST_STREAM, 0, stream_id, _U32.pack(code)))

    def _forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._blocked.discard(stream_id)
        self._stream_unacked.pop(stream_id, None)

    def goaway(self) -> None:
        """Refuses new streams; those open run on (graceful shutdown)."""
        if not self._closing:
            self._closing = True
            self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(NO_ERROR)))

    def close(self, code: int = NO_ERROR, why: str = "") -> None:
        """GOAWAY with `code` and closes; the handler hears of every open stream."""
        if self.transport is None:
            return
        if code != NO_ERROR:
            logger.info("closing HTTP/2 connection from %s: %s", self.peer, why)
        detail = why.encode()[:256]
        self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream) + _U32.pack(code) + detail))
        self.transport.close()


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    length = len(payload)
    return _HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


# ---- HPACK, encoding side: literals only, so no table to keep in step --------------


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with `first`'s high bits in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: str, value: str) -> bytes:
    """A header as a literal never added to the table (RFC 7541 6.2.2)."""
    raw_name, raw_value = name.encode(), value.encode()
    return (
        b"\x00"
        + encode_int(len(raw_name), 7)
        + raw_name
        + encode_int(len(raw_value), 7)
        + raw_value
    )
