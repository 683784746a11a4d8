"""What a peer of our HTTP/2 server may make it hold or do, and the
accounting that keeps it there.

Anyone who reaches the lighthouse's port is such a peer, secret or not: all
of this applies before a call's headers are checked. The numbers follow
grpcio's C-core where it has one (the header-list limits, the 10,000 pending
control answers, the ping policy's shape) and are tighter where ours serves
only small control-plane calls (streams per connection, frame size).
"""

from __future__ import annotations

import dataclasses
import logging
import time


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds of one server; `LIMITS` holds the defaults."""

    max_header_block: int = 16 * 1024
    """Bytes of one header block as sent (HEADERS and CONTINUATIONs), checked
    before it is decoded; C-core's hard metadata limit."""
    max_header_list: int = 16 * 1024
    """Bytes of one decoded header list, counted as RFC 9113 6.5.2 does."""
    max_continuations: int = 64
    """CONTINUATION frames in one header block (empty ones cost nothing else)."""
    max_frame: int = 16_384
    """SETTINGS_MAX_FRAME_SIZE: our calls are small; a partial frame is held."""
    max_streams: int = 100
    """SETTINGS_MAX_CONCURRENT_STREAMS: RFC 9113's smallest advised value; a
    group holds a heartbeat stream and a call or two."""
    stream_window: int = 65_535
    """What a stream may send before its message is consumed: the default
    initial window, so no SETTINGS race; a larger message is granted its
    declared size (`grant`)."""
    connection_window: int = 1 << 20
    """What a connection may send before its messages are consumed."""
    max_grant: int = 4 * 1024 * 1024 + 5
    """The most a connection may be granted at once for declared messages
    beyond the stream window: one message of grpcio's default 4 MiB."""
    process_held: int = 16 * 1024 * 1024
    """Request bytes held (received, not consumed, partial frames and
    header blocks) by all connections together, shared fairly between hosts
    (lighthouse.rpc.h2.shares); the stream that would pass its host's share
    is reset."""
    process_grants: int = 8 * 1024 * 1024 + 10
    """Declared-message grants of all connections together, shared so: one
    host alone may have one message of grpcio's default 4 MiB granted."""
    process_memory: int = 32 * 1024 * 1024
    """What connections keep beyond the request bytes, all together, shared
    so: decoded-header caches (by decoded size) and answers waiting on a
    peer's windows. A host past its share caches nothing more and has its
    new streams refused."""
    write_high: int = 256 * 1024
    """Unsent answer bytes past which a connection is not read further: a
    peer cannot pile up answers (C-core instead counts those pending and
    calms the peer past 10,000); one read's answers are within the work
    budget, and the control answers within their rates."""
    write_low: int = 64 * 1024
    """... and below which it is read again."""
    write_stall_s: float = 30.0
    """A connection whose answers wait this long on a peer that reads none
    (its socket, or its flow-control windows) is dropped."""
    ping_interval_s: float = 1.0
    """A PING sooner than this after the last, with no answer of ours between, is a strike."""
    ping_strikes: int = 10
    """Strikes past which the peer gets GOAWAY ENHANCE_YOUR_CALM (too many pings)."""
    settings_rate: tuple[float, float] = (32.0, 4.0)
    """SETTINGS frames: a burst, then so many a second."""
    reset_rate: tuple[float, float] = (200.0, 50.0)
    """Streams the peer resets, or that we must refuse: a burst, then so many
    a second (rapid reset, CVE-2023-44487)."""
    priority_rate: tuple[float, float] = (100.0, 10.0)
    """PRIORITY frames: RFC 9113 deprecates them and neither our client nor
    grpcio's sends any, yet each costs a frame's work (Envoy allows 100 a stream)."""
    idle_window_update_rate: tuple[float, float] = (100.0, 20.0)
    """WINDOW_UPDATEs that unblock nothing: beyond `window_updates_per_data`
    per DATA frame we sent, and with no answer waiting on a window (Envoy's
    max_inbound_window_update_frames_per_data_frame_sent). A client sends
    one or two as it connects, then about one per DATA frame it reads."""
    window_updates_per_data: int = 10
    """WINDOW_UPDATEs each DATA frame we send earns the peer (Envoy's default)."""
    empty_data_rate: tuple[float, float] = (100.0, 10.0)
    """DATA frames with no payload and no END_STREAM: no work for us but a
    frame's (CVE-2019-9518); a client's half-close is an empty DATA with
    END_STREAM, which passes."""
    closed_stream_rate: tuple[float, float] = (200.0, 100.0)
    """RST_STREAM and WINDOW_UPDATE on streams already closed: a client's may
    cross our last frame, about one a call; more are a flood."""
    answered_headers_rate: tuple[float, float] = (100.0, 20.0)
    """Header blocks on streams already answered: decoded (the HPACK table
    is shared), then dropped; a gRPC client sends none (no trailers)."""
    stream_message_rate: tuple[float, float] = (200.0, 100.0)
    """Request messages on one streaming call, where the server sets a rate
    (LeanServer's `stream_message_rate`; the lighthouse does): a burst, then
    so many a second; past it the call ends RESOURCE_EXHAUSTED, rated as a
    refused call. A lighthouse's streams carry one heartbeat per advised
    interval (0.1-1 s); heartbeats as fast as flow control allows are work,
    taken from everyone."""
    refused_call_rate: tuple[float, float] = (100.0, 20.0)
    """Calls answered without running (unknown method, refused secret,
    unsupported encoding, not gRPC): a misconfigured client retries with
    backoff, far below this; faster is someone probing."""
    work_per_read: int = 512
    """Work units one turn of the loop gives one connection; the rest of its
    read waits for the next turn. A unit is about 2 us here: a frame 1, a
    new stream 8, a SETTINGS entry or a stream its window change walks 1, a
    header block decoded 1 per 4 bytes, a decompressed message 1 per KiB out,
    request bytes copied 1 per 4 KiB."""
    work_per_host_turn: int = 4096
    """... and one host, all its connections together: a host that floods
    over many connections gets a host's turn, not one per connection."""
    max_connections: int = 16_384
    """Open connections; past it the longest idle one makes room."""
    idle_s: float = 300.0
    """A connection with no stream this long is closed (C-core's max_connection_idle)."""
    handshake_s: float = 10.0
    """A connection without the HTTP/2 preface by then is dropped (a port scan)."""
    tls_handshake_s: float = 5.0
    """A TLS handshake not done by then is aborted; it counts against the
    connection cap from accept on (asyncio's default gives it 60 s)."""
    keepalive_s: float = 30.0
    """A connection that sent nothing this long gets a PING: a peer that died
    without a FIN holds its streams until it is found out."""
    ping_timeout_s: float = 10.0
    """... and one whose PING goes unanswered this long is aborted."""
    close_s: float = 5.0
    """A closing connection's last frames get this long to go out, then it is aborted."""
    max_echo: int = 128
    """Characters of a request's own text (a path, a method) an answer may carry."""


LIMITS = Limits()


class TokenBucket:
    """`take` is True while the peer stays within a burst and a rate."""

    __slots__ = ("_tokens", "_burst", "_rate", "_at")

    def __init__(self, burst_and_rate: tuple[float, float]) -> None:
        self._burst, self._rate = burst_and_rate
        self._tokens = self._burst
        self._at = time.monotonic()

    def take(self) -> bool:
        if self._tokens < 1.0:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
            if self._tokens < 1.0:
                return False
        self._tokens -= 1.0
        return True


class PeerLog:
    """Logs the first line per peer host at INFO, the rest at DEBUG: a peer
    that breaks the protocol on every connection shows up once, and cannot
    fill the log. Bounded memory: past `max_hosts` hosts, all at DEBUG."""

    def __init__(self, logger: logging.Logger, max_hosts: int = 1024) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._max = max_hosts

    def log(self, peer: str, message: str) -> None:
        host = peer.rsplit(":", 1)[0]
        first = host not in self._seen and len(self._seen) < self._max
        if first:
            self._seen.add(host)
        self._logger.log(
            logging.INFO if first else logging.DEBUG,
            "closing HTTP/2 connection from %s: %s%s",
            peer,
            message[:200],
            " (more from this host are logged at DEBUG)" if first else "",
        )


class FrameRates:
    """One connection's rates of frames that cost work but carry none (and
    of SETTINGS and resets): over any, the connection ends with
    ENHANCE_YOUR_CALM, counted by kind."""

    __slots__ = (
        "settings",
        "reset",
        "priority",
        "idle_window_update",
        "empty_data",
        "closed_stream",
        "answered_headers",
        "refused_call",
    )

    def __init__(self, limits: Limits) -> None:
        self.settings = TokenBucket(limits.settings_rate)
        self.reset = TokenBucket(limits.reset_rate)
        self.priority = TokenBucket(limits.priority_rate)
        self.idle_window_update = TokenBucket(limits.idle_window_update_rate)
        self.empty_data = TokenBucket(limits.empty_data_rate)
        self.closed_stream = TokenBucket(limits.closed_stream_rate)
        self.answered_headers = TokenBucket(limits.answered_headers_rate)
        self.refused_call = TokenBucket(limits.refused_call_rate)
