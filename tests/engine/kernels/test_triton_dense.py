"""The fused CUDA ops around the GEMMs (engine/kernels/triton_dense.py), proved on the CPU:
under Triton's interpreter against the torch ops they replace (on a GPU machine, compiled
there), compiled for sm_90 with no GPU, and whole models through them against transformers.

Tolerances as the CPU's native ops (test_cpu_kernels.py): float32 to its rounding (the norm's
mean and SiLU's exp are summed and approximated their own way); half types one rounding
step. Rotary rounds as torch does, product by product: float32 bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import triton_dense as td
from engine.models.llama import TORCH_OPS, _rotate_half

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED_BF16 = 2 * 2**-7 if DEVICE.type == "cpu" else 0.0
"""Triton 3.6's interpreter truncates float32 to bfloat16 where the GPU rounds to nearest
(`triton.runtime.interpreter._convert_float`): up to one bfloat16 step more per rounding."""
TOLERANCES = [
    (torch.float32, 0.0, 0.0, 2e-6),
    (torch.bfloat16, INTERPRETED_BF16, 1e-2 + INTERPRETED_BF16, 1e-2 + INTERPRETED_BF16),
    (torch.float16, 0.0, 2e-3, 2e-3),
]
"""(dtype, the residual add's, rotary's and the norm's and SiLU's tolerance)."""


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,add_tol,rotary_tol,tol", TOLERANCES)
def test_fused_ops_equal_the_torch_ops_they_replace(dtype, add_tol, rotary_tol, tol):
    g = torch.Generator().manual_seed(3)
    rows, hidden, heads, dim = 7, 96, 5, 32
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    on = [t.to(DEVICE) for t in (h, delta, weight)]
    close(td.rms_norm(on[0], on[2], 1e-5), TORCH_OPS.rms_norm(h, weight, 1e-5), tol)
    total, normed = td.add_rms_norm(*on, 1e-5)
    want_total, want_normed = TORCH_OPS.add_rms_norm(h, delta, weight, 1e-5)
    close(total, want_total, add_tol)
    close(normed, want_normed, tol)

    # rotary over q and k of a fused projection's view, values passed through beside them
    qkv = torch.randn(rows, (heads + 2) * dim, generator=g).to(dtype).view(rows, heads + 2, dim)
    angles = torch.rand(rows, 1, dim // 2, generator=g) * 6.28
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = td.rotary(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), heads)
    assert got.is_contiguous()
    qk = qkv[:, :heads]
    close(got[:, :heads], qk * cos + _rotate_half(qk) * sin, rotary_tol)
    close(got[:, heads:], qkv[:, heads:], 0.0)  # copied, not rounded
    strided = td.rotary(qkv[:, :heads].to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), heads)
    close(strided, TORCH_OPS.rotary(qk, cos, sin, heads), rotary_tol)

    gate_up = (3 * torch.randn(rows, 2 * hidden, generator=g)).to(dtype)
    close(td.silu_mul(gate_up.to(DEVICE)), TORCH_OPS.silu_mul(gate_up), tol)


def test_rotary_compiles_without_fused_multiply_adds():
    """In float32 the rotary kernel rounds each product as torch does only if the compiler
    does not contract `a * b + c * d` into an FMA (the interpreter never does; the H200's
    compiled kernel did, 2.4e-7 off): compiled for sm_90 (in a process of its own: this one
    runs Triton's interpreter), its PTX has no float32 FMA."""
    from engine.kernels.triton_compile import report_in_own_process

    (row,) = report_in_own_process("--arch", "90", "--dtypes", "fp32", "--kernels", "rotary_rows")
    assert (row["kernel"], row["dtype"], row["fma_f32"]) == ("rotary_rows", "fp32", 0)


def test_long_rows_and_empty_steps():
    """Rows wider than a SiLU block, a hidden size that is no power of two, no rows at all."""
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(3, 2 * (td.SILU_BLOCK + 37), generator=g)
    close(td.silu_mul(gate_up.to(DEVICE)), TORCH_OPS.silu_mul(gate_up), 2e-6)
    x, w = torch.randn(2, 1000, generator=g), torch.rand(1000, generator=g)
    close(td.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6), TORCH_OPS.rms_norm(x, w, 1e-6), 2e-6)
    empty = torch.empty(0, 64, device=DEVICE)
    assert td.rms_norm(empty, torch.ones(64, device=DEVICE), 1e-5).shape == (0, 64)
    assert td.silu_mul(empty).shape == (0, 32)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the CUDA suite runs the engine so")
@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3"])
def test_engine_through_the_fused_ops_matches_transformers(tiny_model, references, kind):
    """A whole model's greedy tokens with its norms, rotary and SiLU through the Triton ops
    (interpreted here): transformers' tokens. Qwen 3 brings its q/k norms, Phi-3 partial
    rotary and windows. Two of the reference prompts (16 and 17 tokens; Phi-3's 21 and 5), a
    ragged batch past Qwen 3's window of 12 and, with its tokens, Phi-3's of 20: each prompt
    token is a rotary program per head under the interpreter, so the other four would only
    repeat the same ops on more rows."""
    from engine import LLM, SamplingParams
    from policy import Policy
    from tests.engine.tiny_models import MAX_TOKENS

    prompts, expected = (part[:2] for part in references(kind))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    calls: dict[str, int] = {}

    def counted(name: str) -> Any:
        op = getattr(td, name)

        def run(*args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return op(*args)

        return run

    from engine.kernels import DenseOps

    ops = DenseOps(*(counted(n) for n in ("rms_norm", "add_rms_norm", "rotary", "silu_mul")))
    with LLM(
        str(tiny_model(kind)),
        policy=Policy(),
        device="cpu",
        dtype="float32",
        native_kernels=False,
        prepack_weights=False,
    ) as llm:
        llm.executor.model.dense_ops = ops
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert calls.get("rms_norm", 0) > 0 and calls.get("silu_mul", 0) > 0, calls
