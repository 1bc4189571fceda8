"""What a decode step of a dense Llama layer dispatches on the CUDA code path, counted on the
CPU (bench/kernels/dispatch_count.py): every aten operator that launches a kernel (views and
allocations apart) plus every Triton kernel launch. With the fused ops (triton_dense.py) and
the decode attention kernel (triton_attention.py) it is 11 (at most 12 holds), vLLM's fused
layer being about 9; torch's own ops launch 29 (docs/benchmarks.md reports both)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bench.kernels.dispatch_count import decode_layer_ops

MAX_KERNELS = 12


def test_a_fused_decode_layer_dispatches_at_most_a_dozen_kernels(tiny_model) -> None:
    plain = decode_layer_ops(tiny_model("llama"), fused=False)
    fused = decode_layer_ops(tiny_model("llama"), fused=True)
    assert fused.kinds()["kernels"] <= MAX_KERNELS < plain.kinds()["kernels"], (
        fused.ops,
        plain.ops,
    )
    launched = {"triton.rms_norm_rows", "triton.rotary_rows", "triton.silu_mul_rows"}
    assert launched | {"triton.decode_split"} <= set(fused.ops)
    assert fused.ops["aten.mm"] == plain.ops["aten.mm"] == 4  # qkv, o, gate_up, down
