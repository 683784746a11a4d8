"""A request's header list, as the server decodes and checks it: HPACK by
the `hpack` library, each repeated block decoded once while the table stays
as it was, and the field rules of RFC 9113 8.2-8.3 (server_connection
refuses a malformed list)."""

from __future__ import annotations

import hpack

from lighthouse.rpc.h2.frames import table_neutral

CACHED_BLOCKS = 16
CACHED_BLOCK_BYTES = 512
"""Decoded blocks kept per connection, and the largest kept: a request's
block is 20-250 bytes; a peer's must not make one hold more."""
CONNECTION_SPECIFIC = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade")
)


class HeaderLists:
    """One connection's decoder of request header blocks."""

    def __init__(self, max_header_list: int) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = max_header_list
        self.cached: dict[bytes, list[tuple[str, str]]] = {}
        """Blocks that leave the table as it was -> their headers, while the
        table is unchanged: a client's repeated call sends the same few bytes."""

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The block's header list, or MALFORMED. Decodes every block that
        may change the table, and each other block once since the table
        last changed (frames.table_neutral: a gRPC client's calls repeat
        their blocks, ours as literals never indexed, grpcio's as indexed
        fields)."""
        if not table_neutral(block):
            self.cached.clear()  # it may have changed the table
            return checked(self._decoder.decode(block, raw=False))  # type: ignore[arg-type]
        headers = self.cached.get(block)
        if headers is None:
            headers = checked(self._decoder.decode(block, raw=False))  # type: ignore[arg-type]
            if len(self.cached) < CACHED_BLOCKS and len(block) <= CACHED_BLOCK_BYTES:
                self.cached[block] = headers
        return headers


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
