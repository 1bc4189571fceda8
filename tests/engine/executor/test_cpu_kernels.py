"""The CPU fast paths: the native kernels (decode attention, fused norm, rotary and SiLU) and
oneDNN's GEMM over prepacked weights run where they should, each with its off switch, and
the fused ops give what the torch ops they replace give (attention: test_attention.py;
whole models: test_correctness.py and the trained-model tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from engine import LLM, SamplingParams
from engine.kernels import DenseOps, dense_ops, isa_level, supported_levels, tiled_prefill
from engine.models.base import can_prepack, linear, prepack
from engine.models.llama import TORCH_OPS, _rotate_half, rms_norm

NATIVE = (
    "nanoflex::paged_decode",
    "nanoflex::paged_prefill",
    "nanoflex::rms_norm",
    "nanoflex::add_rms_norm",
    "nanoflex::rotary",
    "nanoflex::silu_mul",
)


DECODE_TOKENS = 3
"""Tokens `ops_run` generates: a prefill step, then two decode steps (profiled: each step
costs the profiler's bookkeeping of every operator)."""


def ops_run(model_dir: Path, tmp_path: Path, **engine: object) -> set[str]:
    """The operators one greedy generate of two prompts ran on the CPU."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), offload_dir=tmp_path / "offload", device="cpu", **engine)
    with llm, profile() as prof:
        llm.generate([[5, 6, 7, 8], [9, 10]], params)
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_run_the_kernel_and_prepacked_gemms(tiny_model, tmp_path, dtype):
    on = ops_run(tiny_model("llama"), tmp_path / "on", dtype=dtype)
    # prefill chunks: the native kernel with its AVX-512 tiles, else SDPA (tiled_prefill)
    tiles = tiled_prefill(isa_level(), supported_levels())
    prefill = "nanoflex::paged_prefill" if tiles else "aten::scaled_dot_product_attention"
    assert set(NATIVE) - {"nanoflex::paged_prefill"} <= on and prefill in on
    assert tiles or "nanoflex::paged_prefill" not in on
    if can_prepack(torch.device("cpu"), getattr(torch, dtype)):
        assert "mkldnn::_linear_pointwise" in on and "aten::mm" not in on
    else:  # a CPU whose oneDNN has no bfloat16 GEMM: the plain GEMM runs, nothing fails
        assert "mkldnn::_linear_pointwise" not in on and "aten::mm" in on
    assert "aten::silu" not in on and "aten::rsqrt" not in on
    off = ops_run(
        tiny_model("llama"),
        tmp_path / "off",
        dtype=dtype,
        native_kernels=False,
        prepack_weights=False,
    )
    assert not set(NATIVE) & off and "mkldnn::_linear_pointwise" not in off
    assert {"aten::mm", "aten::silu", "aten::rsqrt"} <= off


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_prepacked_weight_gives_what_the_plain_one_gives(dtype, tol):
    """bfloat16: the same oneDNN kernel F.linear calls, bit for bit; float32: oneDNN instead
    of MKL's sgemm, equal to rounding."""
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"this CPU's oneDNN has no {dtype} GEMM to prepack for (can_prepack)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w = {"proj.weight": torch.randn(80, 96, generator=g).to(dtype)}
    w["proj.bias"] = torch.randn(80, generator=g).to(dtype)
    packed = {**w, "proj.weight": prepack(w["proj.weight"])}
    assert packed["proj.weight"].is_mkldnn
    want = linear(x, w, "proj")
    torch.testing.assert_close(linear(x, packed, "proj"), want, atol=tol, rtol=tol)


def built_dense_ops() -> DenseOps:
    ops = dense_ops()
    assert ops is not None, "the native CPU kernels did not build: see the log"
    return ops


# float32: rotary is the same three roundings, bit for bit; the norm's mean and SiLU's exp
# are summed and approximated differently, to within float32 rounding. The half types:
# one rounding step (an ulp at most) where an intermediate lands differently.
TOLERANCES = [(torch.float32, 0.0, 2e-6), (torch.bfloat16, 0.0, 1e-2), (torch.float16, 0.0, 2e-3)]


@pytest.mark.parametrize("dtype,rotary_tol,tol", TOLERANCES)
def test_fused_ops_equal_the_torch_ops_they_replace(dtype, rotary_tol, tol):
    ops = built_dense_ops()
    g = torch.Generator().manual_seed(3)
    rows, hidden, heads, dim = 7, 96, 5, 32
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)

    def close(got: torch.Tensor, want: torch.Tensor, t: float) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=t, rtol=t)

    close(ops.rms_norm(h, weight, 1e-5), rms_norm(h, weight, 1e-5), tol)
    total, normed = ops.add_rms_norm(h, delta, weight, 1e-5)
    close(total, h + delta, 0.0)
    close(normed, rms_norm(h + delta, weight, 1e-5), tol)

    # rotary over q and k of the fused projection, values passed through beside them, and
    # over a strided view of the rotated heads alone
    qkv = torch.randn(rows, (heads + 2) * dim, generator=g).to(dtype).view(rows, heads + 2, dim)
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 6.28
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, :heads]
    want = qk * cos + _rotate_half(qk) * sin
    got = ops.rotary(qkv, cos, sin, heads)
    close(got[:, :heads], want, rotary_tol)
    close(got[:, heads:], qkv[:, heads:], 0.0)
    close(got, TORCH_OPS.rotary(qkv, cos, sin, heads), rotary_tol)
    close(ops.rotary(qk, cos, sin, heads), want, rotary_tol)

    gate_up = (3 * torch.randn(rows, 2 * hidden, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, tol)


def test_fused_ops_refuse_layouts_they_cannot_read():
    ops = built_dense_ops()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="gate then up"):
        ops.silu_mul(torch.randn(4, 7))
