"""One attacking HTTP/2 connection, and the frames, HPACK blocks and gRPC messages it
sends (tools.h2_attacks builds the attacks from it).

Plain sockets and frames built by hand: what a hostile or broken peer sends, which no HTTP/2
client library lets one send. A peer spends within a `Budget` (bytes, seconds) on a
non-blocking socket, so a server that stops reading (flow control, backpressure) ends the
attack at its deadline instead of hanging it.

Everything here is written from RFC 9113 (HTTP/2) and RFC 7541 (HPACK), not from the
server under test, so that its bugs are not copied into its attacker.
"""

from __future__ import annotations

import functools
import resource
import select
import socket
import struct
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field

import hpack

from lighthouse.rpc.h2.frames import encode_int
from lighthouse.rpc.proto import torchft_pb2 as pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE = range(9)
CONTINUATION = 9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
ENABLE_PUSH, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x2, 0x4, 0x5
CANCEL = 0x8
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MB = 1 << 20
SERVICE = "/torchft.LighthouseService/"
SMALL_RCVBUF = 4096
ATTACKER_HOST = "127.0.0.2"
BYSTANDER_HOST = "127.0.0.3"
"""Where an attack's own probe of a healthy host's service comes from."""
"""The loopback address attacks on 127.0.0.1 come from: one host of its own, apart from
the healthy clients on 127.0.0.1 (Linux routes all of 127/8 to loopback), as the
server's per-host shares see a real attacker."""
"""SO_RCVBUF of a peer that never reads: the server's answers back up after a few KB."""

_HEADER = struct.Struct(">BHBBI")
_SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")


# ---- frames, HPACK, gRPC messages -------------------------------------------------------


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """A frame: its 9-byte header (24-bit length, type, flags, 31-bit stream id), then payload."""
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def literal(name: str | bytes, value: str | bytes) -> bytes:
    """A header field as a literal without indexing and without Huffman (RFC 7541 6.2.2): it
    costs the server exactly its size, whatever the server's table holds."""
    raw_name = name.encode() if isinstance(name, str) else name
    raw_value = value.encode() if isinstance(value, str) else value
    return (
        b"\x00"
        + encode_int(len(raw_name), 7)
        + raw_name
        + encode_int(len(raw_value), 7)
        + raw_value
    )


def literals(headers: list[tuple[str, str]]) -> bytes:
    return b"".join(literal(name, value) for name, value in headers)


def method(name: str) -> str:
    return SERVICE + name


def request_headers(authority: str, path: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    """A gRPC call's request headers, as grpcio's client sends them."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def grpc_message(message: bytes, compressed: bool = False, declared: int | None = None) -> bytes:
    """A length-prefixed gRPC message; `declared` overrides the length it claims."""
    return bytes([compressed]) + U32.pack(len(message) if declared is None else declared) + message


def heartbeat_message(replica_id: str) -> bytes:
    return grpc_message(pb.LighthouseHeartbeatRequest(replica_id=replica_id).SerializeToString())


BOMB_BYTES = 1 << 30


@functools.cache
def gzip_bomb() -> bytes:
    """A gzip member (about 1 MB) of BOMB_BYTES zeros. Each 16 MB of zeros deflates, after a
    full flush, to the same bytes, so one chunk is compressed and repeated: a third of a
    second instead of the seconds that compressing a gigabyte takes."""
    chunk, count = 1 << 24, BOMB_BYTES >> 24
    zeros = bytes(chunk)
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    first = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)  # with the gzip header
    again = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    last_block = deflate.flush()[:-8]  # the final empty block; its trailer is for 32 MB
    crc = 0
    for _ in range(count):
        crc = zlib.crc32(zeros, crc)
    return first + again * (count - 1) + last_block + struct.pack("<II", crc, BOMB_BYTES % 2**32)


def raise_nofile(wanted: int) -> None:
    """Raises this process's soft limit on open files (up to the hard limit): one socket a
    connection. Children started afterwards inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


# ---- one attacking connection -----------------------------------------------------------


class Budget:
    """What one attack may spend: bytes sent (all its connections together) and seconds."""

    def __init__(self, max_bytes: int, max_seconds: float) -> None:
        self.max_bytes = max_bytes
        self.deadline = time.monotonic() + max_seconds
        self.sent = 0

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def spent(self) -> bool:
        return self.sent >= self.max_bytes or time.monotonic() >= self.deadline


def _ready(sock: socket.socket, event: int, timeout_s: float) -> bool:
    """Whether `sock` is ready for `event` within `timeout_s`: poll, not
    select, which refuses descriptors past 1,023 (an attack's thousand
    connections, a test process that ran others before)."""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


class Peer:
    """One attacking connection, started with the connection preface and a SETTINGS frame.

    It follows what the server says (its settings, the flow-control windows it grants, GOAWAY,
    RST_STREAM, the headers it answers with) only when `pump` reads: attacks whose answers are
    never read never call it, and then the server's writes back up in its own memory."""

    def __init__(
        self,
        addr: str,
        budget: Budget,
        rcvbuf: int | None = None,
        settings: tuple[tuple[int, int], ...] = (),
        handshake: bool = True,
        source: str = ATTACKER_HOST,
    ) -> None:
        url = urllib.parse.urlsplit(addr if "://" in addr else f"http://{addr}")
        host, port = url.hostname or "127.0.0.1", url.port or 80
        self.authority = f"{host}:{port}"
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if rcvbuf:  # before connect: the TCP window offered is sized from it then
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sockaddr[0] == "127.0.0.1":
                self.sock.bind((source, 0))
            self.sock.settimeout(max(budget.left_s(), 1.0))
            self.sock.connect(sockaddr)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.budget = budget
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 30
        self.settings: dict[int, int] = {}
        """The server's SETTINGS, as last received."""
        self.settings_seen = False
        self.send_window = DEFAULT_WINDOW
        """What the server lets us send on the connection (negative: more than it granted)."""
        self.stream_windows: dict[int, int] = {}
        self.goaway: int | None = None
        """The error code of the server's GOAWAY, if one came."""
        self.closed = ""
        """Why the connection ended ("" while open)."""
        self.answers: dict[int, list[tuple[str, str]]] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.pings_acked: list[bytes] = []
        self.next_stream = 1
        self._in = bytearray()
        self._block = bytearray()
        payload = b"".join(_SETTING.pack(key, value) for key, value in settings)
        self.send(PREFACE + frame(SETTINGS, 0, 0, payload), budgeted=False)
        if handshake:
            self.handshake()

    @property
    def max_frame(self) -> int:
        return self.settings.get(MAX_FRAME_SIZE, DEFAULT_FRAME)

    def stream_window(self, stream_id: int) -> int:
        initial = self.settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
        return self.stream_windows.setdefault(stream_id, initial)

    def send(self, data: bytes, budgeted: bool = True) -> bool:
        """Sends all of `data`; False when the budget runs out first (the attack spent its
        bytes, or its time while the server was not reading) or the connection ended."""
        view = memoryview(data)
        deadline = self.budget.deadline if budgeted else time.monotonic() + 1.0
        while view:
            if self.closed or (budgeted and self.budget.sent >= self.budget.max_bytes):
                return False
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                _ready(self.sock, select.POLLOUT, min(left, 0.05))
                continue
            except OSError as e:
                self.closed = f"{type(e).__name__} while sending"
                return False
            view = view[n:]
            self.budget.sent += n
        return True

    def open(self, headers: list[tuple[str, str]], end_stream: bool = False) -> int:
        """Starts a stream with these headers (HPACK-encoded with indexing); its id."""
        stream_id, self.next_stream = self.next_stream, self.next_stream + 2
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, stream_id, self.encoder.encode(headers)))
        return stream_id

    def send_data(
        self, stream_id: int, data: bytes, end_stream: bool = False, wait: bool = True
    ) -> int:
        """Sends `data` as DATA frames as the server's windows allow, reading its
        WINDOW_UPDATEs while they are shut (wait=False: only what fits now); bytes sent."""
        view, sent = memoryview(data), 0
        while view:
            room = min(len(view), self.send_window, self.stream_window(stream_id), self.max_frame)
            if room <= 0:
                if not wait or self.budget.spent() or not self.pump(0.05):
                    break
                continue
            flags = END_STREAM if end_stream and room == len(view) else 0
            if not self.send(frame(DATA, flags, stream_id, bytes(view[:room]))):
                break
            self.send_window -= room
            self.stream_windows[stream_id] -= room
            view, sent = view[room:], sent + room
        return sent

    def pump(self, wait: float = 0.0) -> bool:
        """Reads and handles what the server sent, waiting up to `wait` s for it to send
        something; False once the connection has ended."""
        if self.closed:
            return False
        readable = _ready(self.sock, select.POLLIN, wait)
        while readable and not self.closed:
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as e:
                self.closed = f"{type(e).__name__} while reading"
                break
            if not chunk:
                self.closed = "closed by the server"
                break
            self._in += chunk
        self._frames()
        return not self.closed

    def drain(self) -> None:
        """Reads and drops what the server sent, unparsed (its answers cost us nothing)."""
        try:
            while self.sock.recv(1 << 20):
                pass
        except OSError:
            pass

    def handshake(self, timeout: float = 2.0) -> None:
        """Waits for the server's SETTINGS (acknowledged by `pump`), and the window update
        a server may send right after it."""
        deadline = time.monotonic() + timeout
        while not self.settings_seen and self.pump(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                break
        self.pump(0.02)

    def probe(self, timeout: float) -> str:
        """Sends a PING and reads until its ACK, a GOAWAY or the end of the connection: has
        the server taken what came before it? "ack", "goaway <code>", "closed" or "timeout"."""
        opaque = b"probe\x00" + U32.pack(len(self.pings_acked))[2:]
        self.send(frame(PING, 0, 0, opaque), budgeted=False)
        deadline = time.monotonic() + timeout
        while self.goaway is None and opaque not in self.pings_acked:
            if not self.pump(min(0.05, max(0.0, deadline - time.monotonic()))):
                break
            if time.monotonic() >= deadline:
                return "timeout"
        if self.goaway is not None:
            return f"goaway {self.goaway}"
        return "ack" if opaque in self.pings_acked else "closed"

    def wait_ended(self, stream_id: int) -> None:
        """Reads until the server ends the stream, or the budget's deadline."""
        while stream_id not in self.ended and stream_id not in self.resets:
            if self.budget.left_s() <= 0 or not self.pump(min(0.05, self.budget.left_s())):
                return

    def state(self) -> str:
        """The connection's end, for an attack's notes."""
        if self.goaway is not None:
            return f"GOAWAY (error code {self.goaway})"
        return self.closed or "open"

    def close(self) -> None:
        self.sock.close()

    def _frames(self) -> None:
        buf, pos = self._in, 0
        while len(buf) - pos >= 9:
            hi, lo, kind, flags, stream_id = _HEADER.unpack_from(buf, pos)
            end = pos + 9 + (hi << 16 | lo)
            if end > len(buf):
                break
            self._frame(kind, flags, stream_id & MAX_WINDOW, bytes(buf[pos + 9 : end]))
            pos = end
        del buf[:pos]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for pos in range(0, len(payload) - 5, 6):
                key, value = _SETTING.unpack_from(payload, pos)
                if key == INITIAL_WINDOW_SIZE:  # RFC 9113 6.9.2: open streams shift with it
                    delta = value - self.settings.get(key, DEFAULT_WINDOW)
                    for open_id in self.stream_windows:
                        self.stream_windows[open_id] += delta
                self.settings[key] = value
            self.settings_seen = True
            self.send(frame(SETTINGS, ACK, 0), budgeted=False)
        elif kind == WINDOW_UPDATE and len(payload) == 4:
            increment = U32.unpack(payload)[0] & MAX_WINDOW
            if stream_id:
                self.stream_windows[stream_id] = self.stream_window(stream_id) + increment
            else:
                self.send_window += increment
        elif kind == PING:
            if flags & ACK:
                self.pings_acked.append(payload)
            else:
                self.send(frame(PING, ACK, 0, payload), budgeted=False)
        elif kind == GOAWAY and len(payload) >= 8:
            self.goaway = U32.unpack_from(payload, 4)[0]
        elif kind == RST_STREAM and len(payload) == 4:
            self.resets[stream_id] = U32.unpack(payload)[0]
        elif kind == DATA and flags & END_STREAM:
            self.ended.add(stream_id)
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                start, stop = 0, len(payload)
                if flags & PADDED:
                    start, stop = 1, stop - payload[0]
                if flags & PRIORITY_FLAG:
                    start += 5
                self._block[:] = payload[start:stop]
                if flags & END_STREAM:
                    self.ended.add(stream_id)
            else:
                self._block += payload
            if flags & END_HEADERS:
                block = self.decoder.decode(bytes(self._block), raw=False)
                self.answers.setdefault(stream_id, []).extend((str(k), str(v)) for k, v in block)


# ---- what an attack holds ---------------------------------------------------------------


@dataclass
class Attack:
    """What an attack did. It holds its connections open until `close()`."""

    budget: Budget
    peers: list[Peer] = field(default_factory=list)
    notes: str = ""
    failures: list[str] = field(default_factory=list)
    """Protocol rules the server broke, as the attack itself saw (the caller fails on them)."""

    @property
    def bytes_sent(self) -> int:
        return self.budget.sent

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


FLOOD_CLOSED_S = 1.0
"""A flood of frames that ask for no work is to be cut off within this long."""


def flood(peer: Peer, budget: Budget, one: bytes, what: str) -> Attack:
    """Sends `one` frame again and again, in batches, until the budget is spent or the
    server drops the connection, which it should within `FLOOD_CLOSED_S`."""
    batch = one * 4096
    start, began = budget.sent, time.monotonic()
    while not budget.spent() and peer.send(batch):
        pass
    took = time.monotonic() - began
    count = (budget.sent - start) // len(one)
    attack = Attack(budget, [peer])
    if peer.closed:
        attack.notes = f"{count} {what} frames, dropped after {took:.2f} s; {peer.state()}"
        if took > FLOOD_CLOSED_S:
            attack.failures.append(f"the flood was cut off after {took:.1f} s")
    else:
        attack.notes = f"{count} {what} frames in {took:.1f} s, never dropped"
        attack.failures.append(f"the flood was never cut off ({took:.1f} s)")
    return attack


def one_more(addr: str, attack: Attack) -> Peer | None:
    """One more connection of the attack that says the preface and waits for
    nothing; None once the budget is spent or connecting fails (said in its notes)."""
    if attack.budget.spent():
        return None
    try:
        peer = Peer(addr, attack.budget, handshake=False)
    except OSError as e:
        attack.notes = f"connect failed: {e}; "
        return None
    attack.peers.append(peer)
    return peer
