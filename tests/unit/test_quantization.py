"""Blockwise int8 quantization: round-trip error bounds, packing, bad input;
and the quantized sum over a process group of one (no peers, no sockets)."""

from __future__ import annotations

import pytest
import torch

from torchft_like import quantization as q
from torchft_like.collectives import allreduce_quantized, quantized_nbytes, ring_allreduce_nbytes
from torchft_like.process_group import ProcessGroupDummy


def _values(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "tiny":
        return torch.randn(n, generator=g) * 1e-30
    if kind == "outlier":
        x = torch.randn(n, generator=g) * 1e-3
        x[n // 2] = 1e3
        return x
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "constant":
        return torch.full((n,), -2.5)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind,n,block_size",
    [
        ("normal", 1, 256),
        ("normal", 255, 256),
        ("normal", 257, 256),
        ("normal", 10_000, 256),
        ("normal", 1000, 1),
        ("normal", 1000, 64),
        ("tiny", 1000, 256),
        ("outlier", 4096, 256),
        ("zeros", 300, 256),
        ("constant", 300, 32),
    ],
)
def test_round_trip_error_is_at_most_half_a_block_scale(kind, n, block_size):
    x = _values(kind, n)
    blocks, scales = q.quantize_int8(x, block_size)
    assert blocks.dtype == torch.int8 and blocks.shape == (q.num_blocks(n, block_size), block_size)
    back = q.dequantize_int8(blocks, scales)[:n]
    bound = scales.repeat_interleave(block_size)[:n] / 2
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6) + 1e-45)
    # each block's largest magnitude comes back (almost) exactly
    absmax = torch.nn.functional.pad(x.abs(), (0, blocks.numel() - n)).view(-1, block_size)
    torch.testing.assert_close(scales * 127, absmax.amax(dim=1), rtol=1e-6, atol=0)


def test_an_outlier_costs_precision_only_in_its_own_block():
    x = _values("outlier", 4096)
    back = q.dequantize_int8(*q.quantize_int8(x, 256))
    spoiled = slice(2048 - 2048 % 256, 2048 - 2048 % 256 + 256)
    others = torch.cat([x[: spoiled.start], x[spoiled.stop :]])
    others_back = torch.cat([back[: spoiled.start], back[spoiled.stop :]])
    assert ((others_back - others).abs() / others.abs().amax()).max() < 1 / 200
    assert torch.all(back[spoiled][torch.arange(256) != 2048 % 256] == 0)  # lost to the outlier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pack_unpack_round_trips_through_one_byte_buffer(dtype):
    x = torch.randn(1000).to(dtype)
    blocks, scales = q.quantize_int8(x, 128)
    buffer = q.pack(blocks, scales)
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == q.packed_nbytes(q.num_blocks(1000, 128), 128)
    assert torch.equal(q.unpack(buffer, 128), q.dequantize_int8(blocks, scales))
    # a slice at an odd offset (as a received chunk may be) unpacks too
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), buffer])[3:]
    assert torch.equal(q.unpack(shifted, 128), q.dequantize_int8(blocks, scales))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: q.quantize_int8(torch.ones(3, dtype=torch.int64)), "floating point"),
        (lambda: q.quantize_int8(torch.ones(3), 0), r"block_size \(0\) must be at least 1"),
        (lambda: q.dequantize_int8(torch.ones(2, 4), torch.ones(2)), "int8 blocks"),
        (lambda: q.unpack(torch.zeros(7, dtype=torch.uint8), 4), "not whole blocks"),
        (lambda: allreduce_quantized(torch.ones(3, dtype=torch.int32), None), "floating point"),
    ],
)
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_quantized_sum_over_one_replica_is_the_tensor_itself():
    t = torch.randn(100)
    before = t.clone()
    allreduce_quantized(t, ProcessGroupDummy()).wait()
    assert torch.equal(t, before)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_quantized_bytes_are_about_a_quarter_of_a_float_ring_allreduce(world):
    numel = 1_000_000
    ratio = quantized_nbytes(numel, world) / ring_allreduce_nbytes(numel, world)
    assert 0.25 < ratio < 0.26
