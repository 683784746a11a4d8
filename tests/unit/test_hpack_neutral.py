"""frames.table_neutral: which header blocks leave the HPACK table as it is,
so that a connection may decode each of them once (http2.Connection._decode)."""

from __future__ import annotations

import pytest
from hpack import Decoder, Encoder
from hypothesis import given
from hypothesis import strategies as st

from lighthouse.rpc.h2.frames import encode_int, literal, table_neutral
from lighthouse.rpc.lean.client import grpc_timeout


def never_indexed(name: str, value: str, huffman: bool = False) -> bytes:
    """RFC 7541 6.2.3 with a new name, as hpack's encoder writes sensitive headers."""
    return bytes(Encoder().encode([(name, value, True)], huffman=huffman))


LEAN_REQUEST = (
    b"\x83\x86"  # :method POST, :scheme http (static, indexed)
    + literal(":path", "/torchft.LighthouseService/Quorum")
    + literal(":authority", "127.0.0.1:29510")
    + literal("content-type", "application/grpc")
    + literal("te", "trailers")
    + literal("grpc-timeout", "59S")
)

CASES = [
    ("our lean client's request", LEAN_REQUEST, True),
    ("indexed static fields", b"\x82\x86\x84", True),
    ("an index past the one-byte prefix", b"\xff\x01", True),
    ("never indexed, new name", never_indexed("x-secret", "s"), True),
    ("never indexed, Huffman", never_indexed("x-secret", "value" * 9, huffman=True), True),
    ("a literal value over 127 bytes", literal("x-long", "v" * 300), True),
    ("without indexing, static name 4 (:path)", b"\x04" + encode_int(3, 7) + b"/ab", True),
    ("a static name index past 4 bits", b"\x0f\x10" + encode_int(1, 7) + b"x", True),
    ("incremental indexing", bytes(Encoder().encode([("x-new", "v")])), False),
    ("a table size update first", b"\x20" + LEAN_REQUEST, False),
    ("cut inside a string", literal(":path", "/abc")[:-2], False),
    ("cut inside an integer", b"\xff", False),
]


@pytest.mark.parametrize(("name", "block", "neutral"), CASES, ids=[c[0] for c in CASES])
def test_table_neutral(name, block, neutral):
    assert table_neutral(block) is neutral


@given(
    st.lists(
        st.tuples(
            st.sampled_from([":path", "te", "x-a", "x-" + "b" * 200, "content-type"]),
            st.text(alphabet="abc/-:0123456789", max_size=150),
            st.booleans(),  # sensitive: never indexed
        ),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_a_neutral_block_is_one_that_leaves_the_decoders_table_unchanged(headers, huffman):
    decoder = Decoder()
    block = bytes(Encoder().encode(headers, huffman=huffman))
    before = list(decoder.header_table.dynamic_entries)
    decoder.decode(block)
    unchanged = list(decoder.header_table.dynamic_entries) == before
    assert table_neutral(block) == unchanged


@pytest.mark.parametrize(
    ("timeout_s", "header"), [(0.0004, "1m"), (2.5, "2500m"), (9.999, "9999m"), (59.7, "59S")]
)
def test_a_long_deadline_travels_in_whole_seconds_so_a_groups_calls_repeat_a_block(
    timeout_s, header
):
    assert grpc_timeout(timeout_s) == header
