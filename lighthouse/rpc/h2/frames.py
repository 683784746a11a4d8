"""HTTP/2 on the wire (RFC 9113), as both of our sides speak it: frame types,
flags and error codes, a frame's checks that do not depend on a
connection's state, and our HPACK encoding (literals only, so no table).

The server side is lighthouse.rpc.h2.server_connection, the client side
lighthouse.rpc.lean.client.
"""

from __future__ import annotations

import struct

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
ERROR_NAMES = {
    NO_ERROR: "NO_ERROR",
    PROTOCOL_ERROR: "PROTOCOL_ERROR",
    INTERNAL_ERROR: "INTERNAL_ERROR",
    FLOW_CONTROL_ERROR: "FLOW_CONTROL_ERROR",
    STREAM_CLOSED: "STREAM_CLOSED",
    FRAME_SIZE_ERROR: "FRAME_SIZE_ERROR",
    REFUSED_STREAM: "REFUSED_STREAM",
    CANCEL: "CANCEL",
    COMPRESSION_ERROR: "COMPRESSION_ERROR",
    ENHANCE_YOUR_CALM: "ENHANCE_YOUR_CALM",
}
"""RFC 9113 7's names of the error codes, for messages."""

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

HEADER = struct.Struct(">BHBBI")
SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
FIXED_LENGTH = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}
"""Frame types whose payload has one length only (RFC 9113 6.3, 6.4, 6.7, 6.9)."""
STREAM_ZERO_ONLY = frozenset((SETTINGS, PING, GOAWAY))
"""Frame types about the connection: on a stream they are a PROTOCOL_ERROR."""
STREAM_ONLY = frozenset((DATA, HEADERS, PRIORITY, RST_STREAM, PUSH_PROMISE, CONTINUATION))
"""Frame types about a stream: on stream 0 they are a PROTOCOL_ERROR."""


class ProtocolError(Exception):
    """The peer broke the protocol: a connection error (GOAWAY, or an abort
    on the client side) with `code`, or with `stream` a stream error
    (RST_STREAM on that stream only)."""

    def __init__(self, code: int, why: str, stream: int = 0) -> None:
        super().__init__(why)
        self.code = code
        self.stream = stream


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    length = len(payload)
    return HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


def check_frame(kind: int, flags: int, stream_id: int, length: int) -> None:
    """The checks of a frame's header alone (RFC 9113 section 6), before its
    payload is looked at: the stream it may be on, and fixed lengths.

    Raises:
        ProtocolError: the connection or stream error the RFC names.
    """
    if stream_id == 0:
        if kind in STREAM_ONLY:
            raise ProtocolError(PROTOCOL_ERROR, f"frame type {kind} on stream 0")
    elif kind in STREAM_ZERO_ONLY:
        raise ProtocolError(PROTOCOL_ERROR, f"frame type {kind} on stream {stream_id}")
    expected = FIXED_LENGTH.get(kind)
    if expected is not None and length != expected:
        why = f"frame type {kind} of {length} bytes, not {expected}"
        # A PRIORITY's length is a stream error; the others' a connection error.
        raise ProtocolError(FRAME_SIZE_ERROR, why, stream_id if kind == PRIORITY else 0)
    if kind == SETTINGS and (length % 6 or (flags & ACK and length)):
        raise ProtocolError(FRAME_SIZE_ERROR, f"a SETTINGS frame of {length} bytes")
    if kind == GOAWAY and length < 8:
        raise ProtocolError(FRAME_SIZE_ERROR, f"a GOAWAY frame of {length} bytes")


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (RFC 9113 6.1, 6.2).

    Raises:
        ProtocolError: the padding is as long as the frame or longer.
    """
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding as long as the frame or longer")
    return payload[1 : len(payload) - payload[0]]


def header_fragment(flags: int, stream_id: int, payload: bytes) -> bytes:
    """A HEADERS frame's block fragment: padding and priority fields removed.

    Raises:
        ProtocolError: bad padding, a short priority field, or a stream
            that depends on itself (a stream error, RFC 9113 5.3.1).
    """
    payload = unpad(flags, payload)
    if flags & PRIORITY_FLAG:
        if len(payload) < 5:
            raise ProtocolError(FRAME_SIZE_ERROR, "a HEADERS priority field cut short")
        if U32.unpack_from(payload)[0] & MAX_WINDOW == stream_id:
            raise ProtocolError(PROTOCOL_ERROR, "a stream that depends on itself", stream_id)
        payload = payload[5:]
    return payload


def settings(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS payload's (identifier, value) pairs, each value checked
    (RFC 9113 6.5.2); unknown identifiers are kept, for the caller to ignore.

    Raises:
        ProtocolError: a value out of its range.
    """
    pairs = [SETTING.unpack_from(payload, pos) for pos in range(0, len(payload), 6)]
    for key, value in pairs:
        if key == SETTINGS_ENABLE_PUSH and value > 1:
            raise ProtocolError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH of {value}")
        if key == SETTINGS_INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise ProtocolError(FLOW_CONTROL_ERROR, f"an initial window of {value}")
        if key == SETTINGS_MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME <= value < 1 << 24:
            raise ProtocolError(PROTOCOL_ERROR, f"a max frame size of {value}")
    return pairs


def window_increment(payload: bytes, stream_id: int) -> int:
    """A WINDOW_UPDATE's increment.

    Raises:
        ProtocolError: an increment of 0 (a stream error on a stream).
    """
    increment: int = U32.unpack(payload)[0] & MAX_WINDOW
    if not increment:
        raise ProtocolError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0", stream_id)
    return increment


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


def frame_at(
    buf: bytearray, pos: int, size: int, max_frame: int
) -> tuple[int, int, int, bytes, int] | None:
    """The frame whose 9-byte header starts at `pos` of the first `size`
    bytes of `buf`: (type, flags, stream id, payload, the offset past it),
    or None while it has not all arrived. Both sides read frames by it.

    Raises:
        ProtocolError: its length is past `max_frame` (FRAME_SIZE_ERROR).
    """
    hi, lo, kind, flags, stream_id = HEADER.unpack_from(buf, pos)
    length = hi << 16 | lo
    if length > max_frame:
        raise ProtocolError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
    end = pos + 9 + length
    if end > size:
        return None
    return kind, flags, stream_id & MAX_WINDOW, bytes(buf[pos + 9 : end]), end


def table_neutral(block: bytes) -> bool:
    """Whether an HPACK header block leaves the decoder's table as it is:
    only indexed fields and literals not added to the table (RFC 7541 6.1,
    6.2.2, 6.2.3), no table size update. Such a block decodes the same until
    the table changes, so it may be decoded once. False for anything else,
    a malformed block included (its decoding says what is wrong)."""
    i, n = 0, len(block)
    try:
        while i < n:
            first = block[i]
            if first & 0x80:  # indexed field
                i = _skip_int(block, i, 0x7F)
            elif first & 0x60:  # incremental indexing (0x40) or a size update (0x20)
                return False
            else:  # a literal without indexing or never indexed; name index in 4 bits
                index_is_zero = first & 0x0F == 0
                i = _skip_int(block, i, 0x0F)
                if index_is_zero:
                    i = _skip_string(block, i)
                i = _skip_string(block, i)
    except IndexError:
        return False
    return i == n


def _skip_int(block: bytes, i: int, mask: int) -> int:
    """The offset past the HPACK integer at `i` whose prefix is `mask`."""
    if block[i] & mask != mask:
        return i + 1
    i += 1
    while block[i] & 0x80:
        i += 1
    return i + 1


def _skip_string(block: bytes, i: int) -> int:
    """The offset past the HPACK string literal at `i`."""
    length, mask = block[i] & 0x7F, 0x7F
    if length != mask:
        return i + 1 + length
    shift, j = 0, i + 1
    while True:
        byte = block[j]
        length += (byte & 0x7F) << shift
        shift += 7
        j += 1
        if not byte & 0x80:
            return j + length
