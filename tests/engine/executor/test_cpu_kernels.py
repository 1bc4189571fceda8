"""The CPU fast paths run where they should: the native decode attention kernel and oneDNN's
GEMM over prepacked weights, each with its off switch (their results: test_attention.py,
test_correctness.py and the trained-model tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from engine import LLM, SamplingParams
from engine.models.base import linear, prepack
from tests.engine.tiny_models import MAX_TOKENS


def ops_run(model_dir: Path, tmp_path: Path, **engine: object) -> set[str]:
    """The operators one greedy generate of two prompts ran on the CPU."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(model_dir), offload_dir=tmp_path / "offload", device="cpu", **engine)
    with llm, profile() as prof:
        llm.generate([[5, 6, 7, 8], [9, 10]], params)
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_run_the_kernel_and_prepacked_gemms(tiny_model, tmp_path, dtype):
    on = ops_run(tiny_model("llama"), tmp_path / "on", dtype=dtype)
    assert "nanoflex::paged_decode" in on
    assert "mkldnn::_linear_pointwise" in on and "aten::mm" not in on
    off = ops_run(
        tiny_model("llama"),
        tmp_path / "off",
        dtype=dtype,
        native_kernels=False,
        prepack_weights=False,
    )
    assert "nanoflex::paged_decode" not in off and "mkldnn::_linear_pointwise" not in off
    assert "aten::mm" in off


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_prepacked_weight_gives_what_the_plain_one_gives(dtype, tol):
    """bfloat16: the same oneDNN kernel F.linear calls, bit for bit; float32: oneDNN instead
    of MKL's sgemm, equal to rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w = {"proj.weight": torch.randn(80, 96, generator=g).to(dtype)}
    w["proj.bias"] = torch.randn(80, generator=g).to(dtype)
    packed = {**w, "proj.weight": prepack(w["proj.weight"])}
    assert packed["proj.weight"].is_mkldnn
    want = linear(x, w, "proj")
    torch.testing.assert_close(linear(x, packed, "proj"), want, atol=tol, rtol=tol)
