"""A request's header list, as the server decodes and checks it: HPACK by
the `hpack` library, each repeated block decoded once while the table stays
as it was, and the field rules of RFC 9113 8.2-8.3 (server_connection
refuses a malformed list)."""

from __future__ import annotations

import hpack

from lighthouse.rpc.h2.frames import table_neutral
from lighthouse.rpc.h2.shares import HostShares

CACHED_BLOCKS = 16
CACHED_BLOCK_BYTES = 512
"""Decoded blocks kept per connection, and the largest kept: a request's
block is 20-250 bytes; a peer's must not make one hold more."""
CONNECTION_SPECIFIC = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade")
)


DECODE_BYTES_PER_UNIT = 4
"""A header block's decode is charged one work unit (Limits.work_per_read)
per so many bytes in and out: 0.1-0.6 us a byte of block here (table-size
updates the dearest), and a few bytes of block may index kilobytes."""
MAX_SIZE_UPDATES = 2
"""Table-size updates a block may start with: RFC 7541 4.2 needs at most
two (the smallest size since the last block, then the new one); more are
work for nothing (a flood of them costs ~10 ms a 16 KiB block)."""


def cached_size(block: bytes, headers: list[tuple[str, str]]) -> int:
    """What a cached block and its decoded list hold in memory, about: each
    field a tuple of two strings, a list slot and the dict's entry."""
    return 200 + len(block) + sum(120 + len(name) + len(value) for name, value in headers)


def size_updates(block: bytes, stop: int = MAX_SIZE_UPDATES + 1) -> int:
    """How many table-size updates (001xxxxx, an integer of 5-bit prefix) the
    block starts with, counted up to `stop` (a flood's block is all of them)."""
    count, pos, size = 0, 0, len(block)
    while pos < size and block[pos] & 0xE0 == 0x20 and count < stop:
        count += 1
        if block[pos] & 0x1F == 0x1F:  # the integer goes on while the high bit is set
            pos += 1
            while pos < size and block[pos] & 0x80:
                pos += 1
        pos += 1
    return count


class HeaderLists:
    """One connection's decoder of request header blocks, and its cache of
    decoded blocks, counted in the process's memory under its host's share."""

    def __init__(self, max_header_list: int, memory: HostShares, host: str = "") -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = max_header_list
        self._memory = memory
        self.host = host
        self.cached: dict[bytes, list[tuple[str, str]]] = {}
        """Blocks that leave the table as it was -> their headers, while the
        table is unchanged: a client's repeated call sends the same few bytes."""
        self.cached_bytes = 0
        """What the cache holds, as counted in the memory pool."""
        self.work = 0
        """The work units of the last `decode` (0: it came from the cache)."""

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's header list, or MALFORMED. Decodes every block that
        may change the table, and each other block once since the table
        last changed (frames.table_neutral: a gRPC client's calls repeat
        their blocks, ours as literals never indexed, grpcio's as indexed
        fields). Raises hpack.HPACKDecodingError on more than two leading
        table-size updates."""
        self.work = 0
        if not table_neutral(block):
            self.clear()  # it may have changed the table
            if block and block[0] & 0xE0 == 0x20 and size_updates(block) > MAX_SIZE_UPDATES:
                raise hpack.HPACKDecodingError("a header block of more than two table size updates")
            return self._decoded(block)
        headers = self.cached.get(block)
        if headers is None:
            headers = self._decoded(block)
            if len(self.cached) < CACHED_BLOCKS and len(block) <= CACHED_BLOCK_BYTES:
                size = cached_size(block, headers)
                if self._memory.take(self.host, size):
                    self.cached[block] = headers
                    self.cached_bytes += size
        return headers

    def _decoded(self, block: bytes) -> list[tuple[str, str]]:
        self.work = 1 + len(block) // DECODE_BYTES_PER_UNIT
        fields = self._decoder.decode(block, raw=False)
        self.work += sum(len(name) + len(value) for name, value in fields) // DECODE_BYTES_PER_UNIT
        return checked(fields)  # type: ignore[arg-type]

    def clear(self) -> None:
        """Empties the cache, and gives its memory back."""
        if self.cached:
            self.cached.clear()
            self._memory.release(self.host, self.cached_bytes)
            self.cached_bytes = 0


MALFORMED: list[tuple[str, str]] = []
"""Stands for a request header list RFC 9113 8.2-8.3 calls malformed."""
PSEUDO_BITS = {":method": 1, ":scheme": 2, ":path": 4, ":authority": 8}
GOOD_NAMES: set[str] = set()
"""Regular field names already found well formed (short ones, at most 256):
most of a request's fields are the same few names."""


def checked(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`fields`, or MALFORMED: an empty or upper-case name, a pseudo-header
    unknown, repeated or after a regular one, a connection-specific field,
    or a TE other than trailers."""
    count, seen = len(fields), 0
    i = 0
    while i < count and fields[i][0][:1] == ":":
        bit = PSEUDO_BITS.get(fields[i][0], 0)
        if not bit or seen & bit:
            return MALFORMED
        seen |= bit
        i += 1
    for name, value in fields[i:]:
        if name not in GOOD_NAMES:
            if not name or name != name.lower() or name[0] == ":" or name in CONNECTION_SPECIFIC:
                return MALFORMED
            if len(name) <= 64 and len(GOOD_NAMES) < 256:
                GOOD_NAMES.add(name)
        if name == "te" and value != "trailers":
            return MALFORMED
    return fields
