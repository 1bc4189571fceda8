"""Tests for group-wise 4-bit quantization and the KV row codec."""

from __future__ import annotations

import pytest
import torch

from engine.storage.quant import (
    KVRowCodec,
    QuantizedTensor,
    dequantize,
    pack_4bit,
    quantize,
    quantized_nbytes,
    unpack_4bit,
)


def _group_errors(x: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Max abs error per group, shaped like q.scale."""
    err = (x.float() - dequantize(q).float()).movedim(q.dim, -1)
    pad = -err.shape[-1] % q.group_size
    err = torch.nn.functional.pad(err, (0, pad))
    return err.abs().unflatten(-1, (-1, q.group_size)).amax(dim=-1)


def _on_grid(shape: tuple[int, ...], group_size: int, seed: int) -> torch.Tensor:
    """Values min + code * scale with float16-exact min and scale, codes 0 and 15 in each group."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, shape, generator=g)
    codes = codes.unflatten(-1, (-1, group_size))
    codes[..., 0], codes[..., 1] = 0, 15  # the group's min and max are on the grid's ends
    num_groups = codes.shape[:-1]
    # scales 1/8..1 and minimums in eighths within +-4: |x| < 20 in steps of 1/8, so the
    # values are exact even in bfloat16's 8-bit mantissa
    scale = 2.0 ** torch.randint(-3, 1, num_groups, generator=g).float()
    min_ = torch.randint(-32, 32, num_groups, generator=g).float() / 8
    return (codes.float() * scale.unsqueeze(-1) + min_.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_values_on_grid_round_trip_exactly(dtype: torch.dtype) -> None:
    x = _on_grid((8, 256), 64, seed=0)
    assert torch.equal(x.to(dtype).float(), x)
    x = x.to(dtype)
    q = quantize(x, group_size=64)
    assert torch.equal(dequantize(q), x)


def test_error_within_half_scale() -> None:
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1)) * 3
    for dim in (0, 1, -1):
        q = quantize(x, group_size=64, dim=dim)
        bound = q.scale.float() / 2
        assert (_group_errors(x, q) <= bound * (1 + 1e-6) + 1e-6).all()


def test_constant_and_extreme_groups() -> None:
    x = torch.tensor([[0.1] * 64, [0.0] * 64, [-1e4] * 32 + [1e4] * 32, [1e-9] * 64])
    q = quantize(x)
    assert (_group_errors(x, q) <= q.scale.float() / 2 * (1 + 1e-6) + 1e-7).all()
    assert torch.equal(dequantize(q)[1], x[1])


def test_packing_layout() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 0..15, 0..15
    packed = pack_4bit(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (16,)
    assert packed[0].item() == 0x10 and packed[1].item() == 0x32  # low nibble = even index
    assert torch.equal(unpack_4bit(packed), codes)
    # quantize puts group g's codes at packed[..., g, :]; min code 0 and max code 15
    x = torch.zeros(4)
    x[1] = 1.0  # codes [0, 15, 0, 0]
    q = quantize(x, group_size=4)
    assert q.packed.shape == (1, 2) and q.packed.tolist() == [[0xF0, 0x00]]
    assert q.scale.dtype == q.min.dtype == torch.float16 and q.scale.shape == (1,)


@pytest.mark.parametrize(
    ("shape", "dim"),
    [((7, 130), -1), ((7, 130), 0), ((3, 5, 65), 1), ((100,), 0), ((2, 1), 1), ((5, 64), 0)],
)
def test_odd_shapes_and_dims(shape: tuple[int, ...], dim: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = x.to(torch.bfloat16)
    q = quantize(x, group_size=64, dim=dim)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert (_group_errors(x, q) <= q.scale.float() / 2 + 1e-2).all()  # + bf16 rounding
    num_groups = -(-shape[dim] // 64)
    assert q.scale.shape[-1] == num_groups and q.packed.shape[-2:] == (num_groups, 32)
    assert q.nbytes == quantized_nbytes(shape, dim, 64) == q.to_bytes().numel()


def test_bytes_round_trip() -> None:
    x = torch.randn(6, 3, 100)
    q = quantize(x, group_size=32, dim=1)
    data = q.to_bytes()
    assert data.dtype == torch.uint8 and data.ndim == 1 and data.numel() == q.nbytes
    back = QuantizedTensor.from_bytes(data, x.shape, 1, 32, torch.float32)
    assert torch.equal(dequantize(back), dequantize(q))
    # a misaligned slice of a larger buffer (as read from disk) still works
    buffer = torch.cat((torch.zeros(1, dtype=torch.uint8), data))
    back = QuantizedTensor.from_bytes(buffer[1:], x.shape, 1, 32, torch.float32)
    assert torch.equal(dequantize(back), dequantize(q))
    with pytest.raises(ValueError, match="bytes"):
        QuantizedTensor.from_bytes(data[:-1], x.shape, 1, 32, torch.float32)


def test_compression_ratio_and_to() -> None:
    x = torch.randn(1024, 1024, dtype=torch.float16)
    q = quantize(x)
    assert q.nbytes == 1024 * 1024 // 2 + 1024 * 16 * 4  # codes + (scale, min) per group
    assert x.numel() * 2 / q.nbytes == pytest.approx(3.56, abs=0.01)
    moved = q.to("cpu")
    assert moved.device.type == "cpu" and torch.equal(dequantize(moved), dequantize(q))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(8), group_size=3)
    with pytest.raises(ValueError, match="dim"):
        quantize(torch.randn(8), dim=1)
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.arange(8))


def test_relative_error_on_normal_data() -> None:
    """The number quoted in docs/compression.md (about 9% for group size 64)."""
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    y = dequantize(quantize(x, group_size=64))
    rel = ((x - y).norm() / x.norm()).item()
    assert 0.08 < rel < 0.10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_row_codec_plain(dtype: torch.dtype) -> None:
    codec = KVRowCodec(row_dim=2 * 2 * 64, dtype=dtype)
    rows = torch.randn(10, 256).to(dtype)  # (N, D): keys then values of one token
    data = codec.encode(rows)
    assert data.shape == (10, codec.row_bytes) and codec.row_bytes == 256 * dtype.itemsize
    assert torch.equal(codec.decode(data), rows)


@pytest.mark.parametrize("row_dim", [256, 200, 64, 3])
def test_kv_row_codec_4bit(row_dim: int) -> None:
    codec = KVRowCodec(row_dim=row_dim, dtype=torch.float16, compress=True)
    num_groups = -(-row_dim // 64)
    assert codec.row_bytes == num_groups * (32 + 2 + 2)
    rows = torch.randn(9, row_dim, dtype=torch.float16)
    data = codec.encode(rows)
    assert data.shape == (9, codec.row_bytes) and data.dtype == torch.uint8
    back = codec.decode(data)
    assert back.shape == rows.shape and back.dtype == torch.float16
    # a row decodes alone, and agrees with quantize() along D
    assert torch.equal(codec.decode(data[4:5]), back[4:5])
    assert torch.equal(back, dequantize(quantize(rows, group_size=64, dim=-1)))
    exact = _on_grid((9, num_groups * 64), 64, seed=3)[:, :row_dim].half()
    if row_dim % 64 == 0:
        assert torch.equal(codec.decode(codec.encode(exact)), exact)


def test_kv_row_codec_rejects_bad_input() -> None:
    codec = KVRowCodec(row_dim=128, compress=True)
    with pytest.raises(ValueError, match="rows"):
        codec.encode(torch.randn(4, 100))
    with pytest.raises(ValueError, match="uint8"):
        codec.decode(torch.zeros(4, codec.row_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="row_dim"):
        KVRowCodec(row_dim=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_matches_cpu(seed: int) -> None:
    x = torch.randn(33, 4096, dtype=torch.float16, generator=torch.Generator().manual_seed(seed))
    for dim in (0, 1):
        q_cpu = quantize(x, dim=dim)
        q_gpu = quantize(x.cuda(), dim=dim)
        assert q_gpu.packed.is_cuda and torch.equal(q_gpu.to("cpu").to_bytes(), q_cpu.to_bytes())
        assert torch.equal(dequantize(q_cpu.to("cuda", non_blocking=True)).cpu(), dequantize(q_cpu))
    codec = KVRowCodec(row_dim=4096, dtype=torch.float16, compress=True)
    assert torch.equal(codec.encode(x.cuda()).cpu(), codec.encode(x))
