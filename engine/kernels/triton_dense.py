"""The small operations around a decoder layer's GEMMs on CUDA, fused in Triton.

In torch, RMSNorm is eight operators (a float32 copy, a square, a mean, an add, a reciprocal
square root, two products, a cast), rotary six, SiLU-and-multiply three: at a decode step's
few rows each is a kernel launch and a trip through the dispatcher, and a dense Llama layer
dispatched some 29 kernels and 34 view operations (tests/engine/kernels/test_dispatch_count.py
counts them). These are one kernel each, one program per row, and round where the torch ops
they replace round (to the tensor's dtype after each of them; the norm's mean and SiLU's exp
are computed their own way, within float32 rounding), as the CPU's native ops do
(dense_ops.cpp). `engine.kernels.cuda_dense_ops()` makes them the `DenseOps` that
`Model.dense_ops` holds on CUDA; `--no-native-kernels` keeps torch's.

CI runs them under Triton's interpreter against the torch ops and compiles them for sm_90
(tests/engine/kernels/test_triton_dense.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.triton_launch import kernel, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @kernel(num_warps=4, num_stages=1)
    def rms_norm_rows(
        X,
        DELTA,
        SUM,
        W,
        OUT,
        stride_x,
        stride_d,
        stride_s,
        stride_o,
        hidden,
        eps,
        HIDDEN_PAD: tl.constexpr,
        ADD: tl.constexpr,
    ):
        """One row: (with ADD: x + delta, rounded, stored in SUM, then) x * rsqrt(mean(x^2) +
        eps) in float32, rounded to the row's type, times the weight, rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, HIDDEN_PAD)
        ok = cols < hidden
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        if ADD:
            x = x.to(tl.float32) + tl.load(DELTA + row * stride_d + cols, mask=ok, other=0.0)
            x = x.to(SUM.dtype.element_ty)
            tl.store(SUM + row * stride_s + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
        normed = (x32 * inv).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=ok)

    # no fused multiply-adds: torch rounds each product before the sum, so in float32 an FMA
    # differs by a rounding (2.4e-7 on the H200)
    @kernel(num_warps=4, num_stages=1, enable_fp_fusion=False)
    def rotary_rows(
        X,
        COS,
        SIN,
        OUT,
        stride_xt,
        stride_xh,
        stride_c,
        heads,
        rotated,
        dim,
        HALF_PAD: tl.constexpr,
    ):
        """One (row, head): x * cos + rotate_half(x) * sin for heads below `rotated` (each
        product rounded, then the sum), the head as it is above; into a contiguous row."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = dim // 2
        cols = tl.arange(0, HALF_PAD)
        ok = cols < half
        src = X + t * stride_xt + h * stride_xh
        dst = OUT + (t * heads + h) * dim
        lo = tl.load(src + cols, mask=ok, other=0.0)
        hi = tl.load(src + half + cols, mask=ok, other=0.0)
        if h < rotated:
            ty = OUT.dtype.element_ty
            c_lo = tl.load(COS + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
            c_hi = tl.load(COS + t * stride_c + half + cols, mask=ok, other=0.0).to(tl.float32)
            s_lo = tl.load(SIN + t * stride_c + cols, mask=ok, other=0.0).to(tl.float32)
            s_hi = tl.load(SIN + t * stride_c + half + cols, mask=ok, other=0.0).to(tl.float32)
            lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
            # rotate_half(x) = [-hi, lo]; each product rounds, then the sum
            new_lo = (lo32 * c_lo).to(ty).to(tl.float32) + (-hi32 * s_lo).to(ty).to(tl.float32)
            new_hi = (hi32 * c_hi).to(ty).to(tl.float32) + (lo32 * s_hi).to(ty).to(tl.float32)
            lo, hi = new_lo.to(ty), new_hi.to(ty)
        tl.store(dst + cols, lo, mask=ok)
        tl.store(dst + half + cols, hi, mask=ok)

    @kernel(num_warps=4, num_stages=1)
    def silu_mul_rows(GATE_UP, OUT, stride_g, stride_o, inter, BLOCK: tl.constexpr):
        """One row, a block of columns: SiLU(gate), rounded, times up, rounded."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(GATE_UP + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GATE_UP + row * stride_g + inter + cols, mask=ok, other=0.0)
        ty = OUT.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (act * up.to(tl.float32)).to(ty), mask=ok)


SILU_BLOCK = 1024
"""Columns of SiLU-and-multiply per program."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _norm(x, None, None, weight, out, eps)
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total, out = torch.empty_like(h), torch.empty_like(h)
    _norm(h, delta, total, weight, out, eps)
    return total, out


def _norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    add = delta is not None and total is not None
    rms_norm_rows.launch(
        (rows,),
        x.is_cuda,
        x,
        delta if add else x,
        total if add else out,
        weight,
        out,
        x.stride(0),
        delta.stride(0) if add else 0,  # type: ignore[union-attr]
        total.stride(0) if add else 0,  # type: ignore[union-attr]
        out.stride(0),
        hidden,
        eps,
        HIDDEN_PAD=next_pow2(hidden),
        ADD=add,
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """(T, heads, D) with heads adjacent and D contiguous (a view of the fused projection is
    fine) -> a contiguous (T, heads, D): heads [0, rotated) rotated, the rest copied."""
    rows, heads, dim = x.shape
    out = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    rotary_rows.launch(
        (rows, heads),
        x.is_cuda,
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        heads,
        rotated,
        dim,
        HALF_PAD=next_pow2(dim // 2),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    silu_mul_rows.launch(
        (rows, -(-inter // SILU_BLOCK)),
        gate_up.is_cuda,
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=SILU_BLOCK,
    )
    return out


COMPILE_CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "rms_norm_rows": (
        ["*{t}"] * 5 + ["i32"] * 5 + ["fp32"],
        dict(HIDDEN_PAD=4096, ADD=True),
    ),
    "rotary_rows": (
        ["*{t}"] * 4 + ["i32"] * 6,
        dict(HALF_PAD=64),
    ),
    "silu_mul_rows": (
        ["*{t}"] * 2 + ["i32"] * 3,
        dict(BLOCK=SILU_BLOCK),
    ),
}  # fmt: skip
"""Each kernel's arguments (tensors typed by the compute type {t}) and constants for a
Llama-3-8B layer (hidden 4096, head_dim 128): `python -m engine.kernels.triton_compile`."""
