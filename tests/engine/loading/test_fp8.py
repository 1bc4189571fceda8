"""FP8 checkpoints as DeepSeek-V3 ships them (e4m3 projections, a float32 `weight_scale_inv` per
block beside each, the quantization_config saying so), written here from a tiny random
DeepSeek-V3: they load to the weights transformers gets from them, and greedy tokens equal
its own on the same files."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.loading.checkpoint import CheckpointReader
from engine.loading.fp8 import dequantize_fp8
from engine.models.config import ModelConfig, read_hf_config
from engine.models.hf_config import UnsupportedModelError
from policy import Policy
from tests.engine.executor.test_correctness import run
from tests.engine.tiny_models import MAX_TOKENS, hf_greedy, random_prompts

E4M3_MAX = 448.0


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float weight -> e4m3 weight and float32 scales, one per block (the last
    blocks partial), each block's largest magnitude mapped to e4m3's largest."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = torch.empty(grid)
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for k in range(grid[1]):
            part = weight[i * block[0] : (i + 1) * block[0], k * block[1] : (k + 1) * block[1]]
            s = float(part.abs().max()) / E4M3_MAX or 1.0
            scale[i, k] = s
            quantized = (part / s).to(torch.float8_e4m3fn)
            out[i * block[0] : (i + 1) * block[0], k * block[1] : (k + 1) * block[1]] = quantized
    return out, scale


Quantize = Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None]
"""(name, tensor) -> the tensors the quantized file holds in its place, or None to keep it."""


def write_quantized(
    source: Path, dest: Path, quantize: Quantize, quantization: dict[str, Any]
) -> Path:
    """A copy of the checkpoint at `source` with the tensors `quantize` converts replaced by
    what it returns and `quantization` as the config's quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(dest / "model.safetensors")).items():
        out.update(quantize(name, tensor) or {name: tensor})
    save_file(out, str(dest / "model.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def write_fp8(source: Path, dest: Path, block: tuple[int, int]) -> Path:
    """A copy of the checkpoint at `source` with every projection (`*_proj*.weight`: attention,
    dense MLP, each expert, the shared one) in FP8 as DeepSeek-V3's files hold them; norms,
    embeddings, the router and the head stay as they were."""

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if "_proj" not in name or not name.endswith(".weight") or tensor.dim() != 2:
            return None
        weight, scale = quantize_fp8(tensor, block)
        return {name: weight, f"{name}_scale_inv": scale}

    quantization = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return write_quantized(source, dest, quantize, quantization)


def test_fp8_checkpoint_loads_transformers_weights_and_tokens(tiny_model, tmp_path):
    """8 x 8 blocks (every projection spans several in both directions; transformers reads
    the block from the scale grid, so the sides are multiples of it): each dequantized
    weight equals the parameter transformers loads from the same file, bit for bit, and
    greedy tokens equal its own with experts and weights on disk."""
    from transformers import AutoModelForCausalLM

    fp8 = write_fp8(tiny_model("deepseek_v3"), tmp_path / "fp8", (8, 8))
    reader = CheckpointReader(fp8)
    assert not any(n.endswith("_scale_inv") for n in reader.names)
    theirs = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).state_dict()
    for name in ("self_attn.q_b_proj", "self_attn.kv_b_proj", "mlp.shared_experts.down_proj"):
        ours = reader.get(f"model.layers.1.{name}.weight")
        assert torch.equal(ours, theirs[f"model.layers.1.{name}.weight"]), name
    stacked = theirs["model.layers.2.mlp.experts.down_proj"]  # (experts, hidden, width)
    assert torch.equal(reader.get("model.layers.2.mlp.experts.3.down_proj.weight"), stacked[3])
    config = ModelConfig.from_hf(read_hf_config(fp8))
    prompts = random_prompts(2, config.vocab_size, 6, 20, seed=5)
    expected = [hf_greedy(fp8, p, MAX_TOKENS) for p in prompts]
    policy = Policy(weights_frac=(0.0, 0.5, 0.5), experts_frac=(0.0, 0.0, 1.0))
    assert run(fp8, prompts, policy, tmp_path) == expected


def test_partial_blocks_as_deepseek_v3_lays_them_out():
    """DeepSeek-V3's kv_a_proj has 576 rows, 4.5 blocks of 128: its scale grid has 5 rows,
    the last block covering the 64 rows left. Dequantized, each block is its scale times its
    e4m3 values; quantized back the weight is within e4m3's rounding."""
    torch.manual_seed(0)
    weight = torch.randn(576, 300)
    quantized, scale = quantize_fp8(weight, (128, 128))
    assert scale.shape == (5, 3)
    restored = dequantize_fp8(quantized, scale, (128, 128))
    assert torch.equal(restored[512:, 256:], quantized[512:, 256:].float() * scale[4, 2])
    assert torch.equal(restored[:128, :128], quantized[:128, :128].float() * scale[0, 0])
    assert float((restored - weight).abs().max() / weight.abs().max()) < 0.07


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fmt": "e5m2"}, "FP8 format 'e5m2'"),
        ({"activation_scheme": "static"}, "activation scheme 'static'"),
        ({"quant_method": "awq"}, "quantization_config"),
    ],
)
def test_other_quantizations_are_refused_by_name(tiny_model, tmp_path, change, message):
    fp8 = write_fp8(tiny_model("deepseek_v3"), tmp_path / "fp8", (8, 8))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"].update(change)
    (fp8 / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(fp8)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf)
