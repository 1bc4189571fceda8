"""MXFP4 experts as gpt-oss ships them (`*_blocks` of packed e2m1 codes and `*_scales` of
power-of-two exponents per 32 values, the quantization_config saying mxfp4), written here
from a tiny random gpt-oss: they load to the weights transformers gets from them, and greedy
tokens equal its own on the same files."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.loading.checkpoint import CheckpointReader
from engine.loading.mxfp4 import E2M1, dequantize_mxfp4
from policy import Policy
from tests.engine.executor.test_correctness import run
from tests.engine.loading.test_fp8 import write_quantized
from tests.engine.tiny_models import GPT_OSS, MAX_TOKENS, hf_greedy, random_prompts


def quantize_mxfp4(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked expert tensor as transformers holds it, (experts, columns, rows) -> blocks
    (experts, rows, columns / 32, 16) and scales (experts, rows, columns / 32): each group of
    32 values of a row scaled by the power of two that brings its largest to at most 6, each
    value the nearest e2m1 code."""
    rows = stacked.transpose(-1, -2)  # (experts, rows, columns), as the file holds them
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4(source: Path, dest: Path) -> Path:
    """A copy of the gpt-oss checkpoint at `source` with its experts' gate_up and down in
    MXFP4 (biases, router, attention, embeddings as they were)."""

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        blocks, scales = quantize_mxfp4(tensor)
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}

    skipped = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": [*skipped, "lm_head"]}
    return write_quantized(source, dest, quantize, quantization)


def test_mxfp4_experts_load_transformers_weights_and_tokens(tiny_model, tmp_path):
    """The dequantized stacked experts equal the parameters transformers loads from the same
    file, bit for bit; greedy tokens equal its own with the experts on disk."""
    from transformers import AutoModelForCausalLM

    quantized = write_mxfp4(tiny_model(GPT_OSS), tmp_path / "mxfp4")
    reader = CheckpointReader(quantized)
    assert not any(n.endswith(("_blocks", "_scales")) for n in reader.names)
    theirs = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32).state_dict()
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        assert torch.equal(reader.get(key), theirs[key].float()), name
    prompts = random_prompts(2, 300, 6, 20, seed=5)
    expected = [hf_greedy(quantized, p, MAX_TOKENS) for p in prompts]
    policy = Policy(experts_frac=(0.0, 0.0, 1.0))
    assert run(quantized, prompts, policy, tmp_path) == expected


def test_codes_and_exponents():
    """Low nibble first; an exponent byte of 127 + e scales its 32 values by 2 ** e."""
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[..., 0] = 0x2F  # values 0 and 1: codes 15 (-6.0) and 2 (1.0)
    scales = torch.tensor([[[127 + 3]]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)  # (1, 32, 1)
    assert out.shape == (1, 32, 1)
    assert out[0, :2, 0].tolist() == [-48.0, 8.0] and not out[0, 2:].any()
