"""GGUF files of the families issue 37 added (DeepSeek-V3, gpt-oss, GLM-4.5, Llama 4, SmolLM3,
OLMo 3), written from tiny random checkpoints the way llama.cpp's converter writes them: its
metadata keys, its tensor names, q/k rows permuted for SmolLM3, experts stacked per projection
(gpt-oss's and Llama 4's transposed back, gpt-oss's gate and up de-interleaved), DeepSeek's
kv_b_proj split per head into attn_k_b (transposed) and attn_v_b (or kept whole, as files from
before April 2025 do), GLM's multi-token-prediction block appended, gpt-oss's experts in GGUF's
MXFP4 blocks (one e8m0 byte, then 16 bytes: value j in the low nibble of byte j, value j + 16
in its high nibble)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.engine.loading.gguf_files import (
    add_shape_keys,
    llama3_rope,
    llama3_rope_freqs,
    permute_like_llama_cpp,
)
from tests.engine.tiny_models import TINY_CONFIGS, build_from_spec

GGUF_ARCH = {
    "deepseek_v3": "deepseek2",
    "gpt_oss": "gpt-oss",
    "glm4_moe": "glm4moe",
    "llama4_text": "llama4",
    "smollm3": "smollm3",
    "olmo3": "olmo2",
}
"""transformers model type -> the GGUF architecture llama.cpp writes for it."""
LLAMA4 = dict(
    TINY_CONFIGS["llama4_text"], attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1
)
"""The tiny Llama 4 with what llama.cpp's runtime assumes of every Llama 4 file: chunks of
8192 tokens, query temperature floor 8192 and scale 0.1."""
GIANT_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": TINY_CONFIGS["deepseek_v3"],
    "glm4_moe": TINY_CONFIGS["glm4_moe"],
    "olmo3": TINY_CONFIGS["olmo3"],
    # what llama.cpp's runtime assumes where the file says nothing: gpt-oss's SwiGLU limit 7,
    # SmolLM3 every fourth layer NoPE and no window (Llama 4: LLAMA4)
    "gpt_oss": dict(TINY_CONFIGS["gpt_oss"], swiglu_limit=7.0),
    "llama4_text": LLAMA4,
    # Llama 4 Scout's rope scaling (llama3 without a blended band), which llama.cpp writes
    # only as per-pair factors (rope_freqs)
    "llama4_scout": dict(LLAMA4, rope_parameters=llama3_rope(5e5, 16.0, 1.0, 8192)),
    "smollm3": dict(
        TINY_CONFIGS["smollm3"],
        no_rope_layers=None,
        no_rope_layer_interval=4,
        use_sliding_window=False,
        sliding_window=None,
    ),
}
MTP_TENSORS = ("nextn.eh_proj.weight", "nextn.enorm.weight", "attn_norm.weight")
"""Some of the tensors of GLM's multi-token-prediction block (blk.<layers>.*), for the
converter to skip."""


def build_giant(kind: str, path: Path) -> Path:
    """The tiny random checkpoint of GIANT_CONFIGS[kind], its norm epsilon a float32 number
    (as the file stores it)."""
    return build_from_spec(dict(GIANT_CONFIGS[kind], rms_norm_eps=2.0**-20), path)


def write_giant_gguf(
    hf_dir: Path, path: Path, *, kv_b: str = "split", mxfp4_dir: Path | None = None
) -> Path:
    """A float32 GGUF of the checkpoint in `hf_dir`; `kv_b` "split" (attn_k_b, attn_v_b) or
    "whole" (attn_kv_b) for DeepSeek; `mxfp4_dir`: gpt-oss's experts taken in MXFP4 from the
    quantized copy of the checkpoint there (tests/engine/loading/test_mxfp4.py)."""
    from gguf import GGUFWriter
    from transformers import AutoModelForCausalLM

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = GGUFWriter(str(path), arch)
    add_shape_keys(writer, arch, _shape_keys(arch, config))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    _METADATA[arch](writer, config)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = {n: t.numpy() for n, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    tensors = dict(_renamed(arch, config, state, kv_b))
    if mxfp4_dir is not None:
        tensors.update(_mxfp4_experts(mxfp4_dir))
    for name, (values, raw) in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(values), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _shape_keys(arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The sizes llama.cpp writes where they are not transformers': MLA as one KV head, GLM's
    blocks with the MTP one, Llama 4's dense feed-forward width."""
    if arch == "deepseek2":
        return dict(config, num_key_value_heads=1)
    if arch == "glm4moe":
        return dict(config, num_hidden_layers=config["num_hidden_layers"] + 1)
    if arch == "llama4":
        return dict(config, intermediate_size=config["intermediate_size_mlp"])
    return config


def _renamed(arch: str, config: dict[str, Any], state: dict[str, np.ndarray], kv_b: str) -> Any:
    """(GGUF name, (values, None)) for every tensor, as llama.cpp's converter writes it."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    layers = config["num_hidden_layers"]
    table = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), layers)
    for name, values in state.items():
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        name = name.replace("self_attn.sinks", "self_attn.sinks.weight")
        module, _, suffix = name.rpartition(".")
        if module.endswith("experts"):
            yield from _experts(arch, module.split(".")[2], suffix, values)
            continue
        gguf_name = f"{table.get_name(module)}.{suffix}"
        if arch == "smollm3" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = config[
                "num_attention_heads" if ".attn_q." in gguf_name else "num_key_value_heads"
            ]
            values = permute_like_llama_cpp(values, heads)
        if gguf_name.endswith("attn_kv_b.weight") and kv_b == "split":
            yield from _split_kv_b(gguf_name, config, values)
            continue
        yield gguf_name, (values, None)
    if arch == "glm4moe":  # the MTP block llama.cpp's converter appends after the layers
        for part in MTP_TENSORS:
            yield f"blk.{layers}.{part}", (np.ones(config["hidden_size"], np.float32), None)


def _experts(arch: str, block: str, suffix: str, values: np.ndarray) -> Any:
    """transformers' stacked expert tensor -> llama.cpp's per-projection (experts, out, in)."""
    prefix = f"blk.{block}"
    kind = "bias" if suffix.endswith("_bias") else "weight"
    if suffix.startswith("down_proj"):
        down = (
            values.swapaxes(-1, -2)
            if arch in ("gpt-oss", "llama4") and kind == "weight"
            else values
        )
        yield f"{prefix}.ffn_down_exps.{kind}", (down, None)
        return
    if arch == "gpt-oss":  # (experts, in, 2 out), gate in the even columns
        rows = values if kind == "bias" else values.swapaxes(-1, -2)
        gate, up = rows[:, 0::2], rows[:, 1::2]
    elif arch == "llama4":  # (experts, in, gate + up)
        gate, up = np.split(values.swapaxes(-1, -2), 2, axis=1)
    else:  # (experts, gate + up, in)
        gate, up = np.split(values, 2, axis=1)
    yield f"{prefix}.ffn_gate_exps.{kind}", (gate, None)
    yield f"{prefix}.ffn_up_exps.{kind}", (up, None)


def _split_kv_b(gguf_name: str, config: dict[str, Any], values: np.ndarray) -> Any:
    """llama.cpp's converter since April 2025: kv_b per head, k_b transposed, v_b as it is."""
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    per_head = values.reshape(heads, nope + config["v_head_dim"], values.shape[-1])
    k_b, v_b = per_head[:, :nope], per_head[:, nope:]
    prefix = gguf_name.removesuffix("attn_kv_b.weight")
    yield f"{prefix}attn_k_b.weight", (k_b.swapaxes(1, 2), None)
    yield f"{prefix}attn_v_b.weight", (v_b, None)


def _mxfp4_experts(quantized: Path) -> dict[str, tuple[np.ndarray, Any]]:
    """gpt-oss's expert weights repacked from its safetensors MXFP4 (`*_blocks`, `*_scales`)
    into GGUF's MXFP4 blocks, gate_up's rows split alternately into gate and up."""
    from gguf import GGMLQuantizationType
    from safetensors.numpy import load_file

    out: dict[str, tuple[np.ndarray, Any]] = {}
    tensors = load_file(str(quantized / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        block = base.split(".")[2]
        packed = _ggml_mxfp4(tensors[name], tensors[f"{base}_scales"])
        if base.endswith("down_proj"):
            out[f"blk.{block}.ffn_down_exps.weight"] = (packed, GGMLQuantizationType.MXFP4)
        else:
            out[f"blk.{block}.ffn_gate_exps.weight"] = (packed[:, 0::2], GGMLQuantizationType.MXFP4)
            out[f"blk.{block}.ffn_up_exps.weight"] = (packed[:, 1::2], GGMLQuantizationType.MXFP4)
    return out


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(..., groups, 16) codes two a byte (value 2i low, 2i + 1 high) and (..., groups)
    exponents -> (..., groups * 17) ggml bytes: the exponent, then value j low and j + 16 high."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return packed.reshape(*packed.shape[:-2], -1)


def _deepseek2(writer: Any, config: dict[str, Any]) -> None:
    rope = config["rope_parameters"]
    rank, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope_dim)
    writer.add_value_length(rank)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_rope_dimension_count(rope_dim)
    _grouped_moe(writer, config)
    _rope(writer, rope)
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _glm4moe(writer: Any, config: dict[str, Any]) -> None:
    writer.add_nextn_predict_layers(1)
    _head_size(writer, config["head_dim"])
    rope = config["rope_parameters"]
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    _grouped_moe(writer, config)
    _rope(writer, rope)


def _grouped_moe(writer: Any, config: dict[str, Any]) -> None:
    """DeepSeek's and GLM's router: sigmoid, groups, shared experts, scaled, dense first."""
    from gguf import ExpertGatingFuncType

    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    _expert_keys(writer, config, config["moe_intermediate_size"], config["n_routed_experts"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


def _gpt_oss(writer: Any, config: dict[str, Any]) -> None:
    _head_size(writer, config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    _expert_keys(writer, config, config["intermediate_size"], config["num_local_experts"])
    _rope(writer, config["rope_parameters"])


def _llama4(writer: Any, config: dict[str, Any]) -> None:
    _head_size(writer, config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    _expert_keys(writer, config, config["intermediate_size"], config["num_local_experts"])
    rope = config["rope_parameters"]
    _rope(writer, rope)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, config["head_dim"]))


def _head_size(writer: Any, head_dim: int) -> None:
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _expert_keys(writer: Any, config: dict[str, Any], width: int, num_experts: int) -> None:
    writer.add_expert_feed_forward_length(width)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])


def _smollm3(writer: Any, config: dict[str, Any]) -> None:
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    _rope(writer, config["rope_parameters"])


def _olmo3(writer: Any, config: dict[str, Any]) -> None:
    rope = config["rope_parameters"]
    _rope(writer, rope["full_attention"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])


def _rope(writer: Any, rope: dict[str, Any]) -> None:
    """The base and, for YaRN, what llama.cpp's converter writes of it."""
    from gguf import RopeScalingType

    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                getattr(writer, f"add_rope_scaling_yarn_{key}")(rope[key])


_METADATA = {
    "deepseek2": _deepseek2,
    "glm4moe": _glm4moe,
    "gpt-oss": _gpt_oss,
    "llama4": _llama4,
    "smollm3": _smollm3,
    "olmo2": _olmo3,
}
"""GGUF architecture -> the metadata llama.cpp's converter adds for it."""
