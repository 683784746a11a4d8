"""The pickle-free state format: tree encoding, header validation, byte ranges."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from torchft_like.checkpointing import state_format


def header_of(tree, step=7, **overrides) -> bytes:
    doc = {"format": state_format.FORMAT_VERSION, "step": step, "checksum": "crc32c", "tree": tree}
    doc.update(overrides)
    return json.dumps(doc).encode()


def leaf(**overrides):
    spec = {"dtype": "float32", "shape": [2, 3], "nbytes": 24, "device": "cpu"}
    return {"tensor": {**spec, **overrides}}


def test_a_tree_survives_encoding_with_int_keys_tuples_and_plain_values():
    state = {
        "model": {"w": torch.zeros(2, 3), "b": torch.zeros(0, dtype=torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"betas": (0.9, 0.99)}]},
        "extra": [None, True, 1, 2.5, float("inf"), "s", 10**30],
    }
    tree, tensors = state_format.flatten(state)
    encoded = state_format.encode_header(7, tree, "crc32")
    length = state_format.decode_prefix(encoded[: state_format.PREFIX.size])
    header = state_format.decode_header(encoded[state_format.PREFIX.size :])

    assert length == len(encoded) - state_format.PREFIX.size
    assert (header.step, header.checksum) == (7, "crc32")
    assert [(s.dtype, s.shape, s.nbytes, s.path) for s in header.specs] == [
        (torch.float32, (2, 3), 24, "state['model']['w']"),
        (torch.bfloat16, (0,), 0, "state['model']['b']"),
        (torch.float32, (), 4, "state['optim']['state'][0]['step']"),
    ]
    rebuilt = state_format.unflatten(header.tree, tensors)
    assert rebuilt["optim"]["state"][0]["step"] is tensors[2]
    assert rebuilt["optim"]["groups"] == [{"betas": (0.9, 0.99)}]
    assert rebuilt["extra"] == state["extra"]
    assert list(rebuilt) == list(state)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"model": {"fn": print}}, r"state\['model'\]\['fn'\]: values of type builtin_function"),
        ({"a": [1, {2}]}, r"state\['a'\]\[1\]: values of type set"),
        ({(1, 2): 0}, r"state: dict key \(1, 2\) is not a str or an int"),
        ({True: 0}, r"dict key True is not a str or an int"),
        ({"s": torch.zeros(2).to_sparse()}, r"state\['s'\]: torch.sparse_coo tensor"),
        ({"m": torch.zeros(2, device="meta")}, r"state\['m'\]: .* on meta has no plain bytes"),
        ({"q": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, r"state\['q'\]: tensors of dtype"),
    ],
)
def test_values_the_format_cannot_carry_are_a_type_error_naming_their_path(state, message):
    with pytest.raises(TypeError, match=message):
        state_format.flatten(state)


@pytest.mark.parametrize(
    "body, message",
    [
        (pickle.dumps({"w": 1}), "header is not JSON"),
        (b"[1, 2]", "an object with a format"),
        (header_of(None, format=1), "format 1 is not supported"),
        (header_of(None, extra=1), "exactly format, step, checksum and tree"),
        (header_of(None, step="7"), "step '7' is not an int"),
        (header_of(None, checksum=None), "checksum None is not an algorithm name"),
        (header_of({"set": [1]}), "unknown node kind 'set'"),
        (header_of({"dict": [], "list": []}), "unexpected node"),
        (header_of({"dict": [[True, 1]]}), "dict items must be"),
        (header_of({"dict": [[1.5, 1]]}), "dict items must be"),
        (header_of(leaf(dtype="object")), "unknown dtype 'object'"),
        (header_of(leaf(dtype=["float32"])), "unknown dtype"),
        (header_of(leaf(shape=[-1, 3])), "bad shape"),
        (header_of(leaf(shape="2x3")), "bad shape"),
        (header_of(leaf(nbytes=1 << 40)), "nbytes 1099511627776 does not fit"),
        (header_of(leaf(device=None)), "bad device"),
        (header_of({"tensor": {"dtype": "float32"}}), "exactly dtype, shape, nbytes and device"),
        (header_of({"list": [1, leaf(code="x")]}), r"state\[1\]: a tensor leaf has exactly"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON|too deeply"),
    ],
)
def test_a_malformed_header_is_refused_with_the_reason(body, message):
    with pytest.raises(ValueError, match=message):
        state_format.decode_header(body)


@pytest.mark.parametrize(
    "prefix, message",
    [
        (pickle.dumps("x")[:16].ljust(16, b"\0"), "not a torchft_like state stream"),
        (state_format.PREFIX.pack(state_format.MAGIC, 1 << 40), "exceeds the"),
        (state_format.MAGIC, "stream ended after 8 of 16 prefix bytes"),
    ],
)
def test_a_bad_prefix_is_refused(prefix, message):
    with pytest.raises(ValueError, match=message):
        state_format.decode_prefix(prefix)


@pytest.mark.parametrize(
    "nbytes, num_chunks",
    [([], 4), ([10], 1), ([10], 3), ([0, 5, 0, 7], 4), ([1, 1], 8), ([100, 3, 50], 2)],
)
def test_chunks_cover_every_byte_exactly_once(nbytes, num_chunks):
    ranges = state_format.chunk_ranges(sum(nbytes), num_chunks)
    covered = [[0] * size for size in nbytes]
    for start, end in ranges:
        for index, offset, length in state_format.segments(nbytes, start, end):
            assert length > 0
            for k in range(offset, offset + length):
                covered[index][k] += 1

    assert len(ranges) == num_chunks
    assert all(count == 1 for tensor in covered for count in tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.zeros(0, 4, dtype=torch.int64),
        torch.randn(3, dtype=torch.complex64).conj(),
    ],
)
def test_tensor_bytes_are_read_in_the_logical_order(tensor):
    flat = state_format.flat_bytes(tensor)
    received = state_format.empty(
        state_format.TensorSpec(tensor.dtype, tuple(tensor.shape), flat.numel(), "cpu")
    )
    state_format.memview(received)[:] = state_format.memview(flat)

    assert torch.equal(received, tensor.resolve_conj())
