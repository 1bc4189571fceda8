"""Small GGUF files written the way llama.cpp's converter writes them, from tiny checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
"""Model type of a tiny checkpoint -> the GGUF architecture llama.cpp writes for it (Mixtral is a
`llama` file with experts)."""
EXPERT_PARTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
"""transformers' stacked expert tensor -> the GGUF tensors llama.cpp splits it into."""


def write_gguf(hf_dir: Path, path: Path) -> Path:
    """A float32 GGUF of the checkpoint in `hf_dir` (config.json + model.safetensors): llama.cpp's
    metadata keys and tensor names, q/k rows permuted as llama.cpp does for Llama, no tokenizer.
    A mixture of experts as llama.cpp writes it: each layer's experts stacked
    (`blk.N.ffn_{gate,up,down}_exps.weight`, (experts, out, in)), the router `ffn_gate_inp`,
    Qwen2-MoE's shared expert gate a vector, expert counts and widths in the metadata."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = GGUFWriter(str(path), arch)
    add_shape_keys(writer, arch, config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "llama3":  # Llama 3.1's scaling, as one factor per pair
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if "num_experts_per_tok" in config:
        _add_expert_keys(writer, config, head_dim)
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, config["num_hidden_layers"])
    for name, tensor in _checkpoint_tensors(hf_dir, "num_experts_per_tok" in config):
        module, _, suffix = name.rpartition(".")
        values = tensor.to(torch.float32).numpy()
        if module.endswith("mlp.experts"):  # (experts, out, in), gate and up one tensor
            parts = EXPERT_PARTS[suffix]
            for part, chunk in zip(parts, np.split(values, len(parts), axis=1), strict=True):
                writer.add_tensor(f"blk.{module.split('.')[2]}.{part}.weight", chunk.copy())
            continue
        gguf_name = f"{table.get_name(module)}.{suffix}"
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            values = permute_like_llama_cpp(values, heads if ".attn_q." in gguf_name else kv_heads)
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            values = values[0]  # llama.cpp stores the (1, hidden) gate as a vector
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope(theta: float, factor: float, high: float, original: int) -> dict[str, Any]:
    """transformers' `llama3` rope parameters (low_freq_factor 1, as every Llama 3.x and 4)."""
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes for `llama3` rope parameters: per rotated pair, 1
    under the short wavelength, `factor` over the long one, the blend between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            share = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - share) / factor + share))
    return np.array(out, np.float32)


def _checkpoint_tensors(hf_dir: Path, is_moe: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by transformers' name: as saved, or, for a mixture of experts,
    as transformers 5 holds them in memory (each layer's experts stacked)."""
    if not is_moe:
        from safetensors.torch import load_file

        yield from load_file(hf_dir / "model.safetensors").items()
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    yield from model.state_dict().items()


def _add_expert_keys(writer: Any, config: dict[str, Any], head_dim: int) -> None:
    """The metadata llama.cpp writes for a mixture of experts (its head size too)."""
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in config:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def add_shape_keys(writer: Any, arch: str, config: dict[str, Any]) -> None:
    """The metadata every llama.cpp file carries: name, sizes, head counts, norm epsilon."""
    heads = config["num_attention_heads"]
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def permute_like_llama_cpp(values: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: within each head, interleave the two rotary halves."""
    rows = values.shape[0]
    split = values.reshape(num_heads, 2, rows // num_heads // 2, *values.shape[1:])
    return split.swapaxes(1, 2).reshape(values.shape)


RawTensors = dict[str, tuple[np.ndarray, int | None]]
"""GGUF name -> (array, raw ggml type id, or None for the array's own float type)."""


def write_raw_gguf(
    path: Path, arch: str, tensors: RawTensors, metadata: dict[str, Any] | None = None
) -> Path:
    """A GGUF holding `general.architecture`, the given `<arch>.` metadata keys and tensors: for
    files the converter must refuse, and for reading metadata alone."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        name = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_array(name, value)
    for name, (array, raw_type) in tensors.items():
        raw = None if raw_type is None else GGMLQuantizationType(raw_type)
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
