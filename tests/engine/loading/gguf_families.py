"""GGUF files of the newer families (Qwen 3, Gemma 2/3, Phi-3, OLMo 2), written the way llama.cpp's
converter writes them (its metadata keys, tensor names, Gemma's norms as 1 + w, Phi-3's LongRoPE
factors as tensors), in any of the quantizations people download, with a byte-level BPE
tokenizer and a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.engine.loading.gguf_files import add_shape_keys
from tests.engine.loading.kquants import ENCODERS
from tests.engine.tiny_models import build_from_spec

GGUF_ARCH = {
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
}
"""transformers model type -> the GGUF architecture llama.cpp writes."""
QUANT_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
MIXED = {"attn_v": "Q6_K", "output.": "Q6_K", "ffn_down": "Q5_K", "token_embd": "Q8_0"}
"""A Q4_K_M-like file: these tensors in these types, the other matrices Q4_K, norms F32."""
_SHAPE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    vocab_size=280,
    rms_norm_eps=2.0**-20,  # a float32 number, as the file stores it
)
GGUF_CONFIGS: dict[str, dict[str, Any]] = {
    # rows of 256 or 512 everywhere, so every K-quant applies (blocks of 256)
    "qwen3": dict(_SHAPE, model_type="qwen3", num_attention_heads=8, tie_word_embeddings=True),
    "gemma2": dict(
        _SHAPE,
        model_type="gemma2",
        query_pre_attn_scalar=64,  # llama.cpp's assumption (head_dim) for all but 27B
        sliding_window=10,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
    ),
    "gemma3": dict(
        _SHAPE,
        model_type="gemma3_text",
        query_pre_attn_scalar=64,
        sliding_window=10,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        ),
    ),
    "phi3": dict(
        _SHAPE,
        model_type="phi3",
        max_position_embeddings=96,
        original_max_position_embeddings=32,
        partial_rotary_factor=0.75,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0 + i / 8 for i in range(24)],
            long_factor=[2.0 + i for i in range(24)],
        ),
        sliding_window=20,
        tie_word_embeddings=False,
    ),
    "olmo2": dict(_SHAPE, model_type="olmo2", tie_word_embeddings=False),
}
SCALED = {"gemma2": {"q_proj": 12.0, "k_proj": 12.0}}
CHAT_TEMPLATES = {
    "chatml": (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "turns": (  # refuses a system message, as Gemma's templates do
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
        "else m['role'] %}{{ '<|im_start|>' + role + '\\n' + m['content'] | trim + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>model\\n' }}{% endif %}"
    ),
}
TEMPLATE_OF = {"gemma2": "turns", "gemma3": "turns"}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "e r", "o n", "Ġ a", "r e", "a t", "e n")


def build_gguf_checkpoint(kind: str, path: Path) -> Path:
    """The tiny safetensors checkpoint of GGUF_CONFIGS[kind], with random weights and the GGUF
    tokenizer's special ids."""
    tokens, _ = tokenizer_tokens(int(GGUF_CONFIGS[kind]["vocab_size"]))
    bos, eos = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    scaled = SCALED.get(kind, {})
    return build_from_spec(
        GGUF_CONFIGS[kind],
        path,
        scaled=scaled,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
    )


def tokenizer_tokens(vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, token types) of a byte-level BPE vocabulary `vocab_size` long: the 256 bytes,
    the merges' results, the special tokens (control), then unused ones."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    tokens += [merge.replace(" ", "") for merge in MERGES]
    types = [1] * len(tokens) + [3] * len(SPECIAL_TOKENS)
    tokens += list(SPECIAL_TOKENS)
    unused = vocab_size - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(unused)], types + [5] * unused


def write_family_gguf(
    hf_dir: Path, path: Path, qtype: str = "F16", *, mixed: bool = False, tokenizer: bool = True
) -> Path:
    """A GGUF of the checkpoint in `hf_dir`: every matrix in `qtype` (or MIXED), norms F32."""
    from gguf import GGUFWriter, RopeScalingType
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    kind = "gemma3" if arch == "gemma3" else config["model_type"]
    writer = GGUFWriter(str(path), arch)
    add_shape_keys(writer, arch, config)
    head_dim = config["head_dim"]
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config["rope_parameters"]
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window(config["sliding_window"])
        local = [kind == "sliding_attention" for kind in config["layer_types"]]
        writer.add_sliding_window_pattern(local)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    if tokenizer:
        _add_tokenizer(writer, config, CHAT_TEMPLATES[TEMPLATE_OF.get(kind, "chatml")])
    for name, values in {**_tensors(hf_dir, config, arch, load_file), **extra}.items():
        type_name = _type_of(name, values, qtype, mixed)
        data, raw = _encode(values, type_name)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(hf_dir: Path, config: dict[str, Any], arch: str, load: Any) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, as its converter stores them."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, config["num_hidden_layers"])
    out = {}
    for name, tensor in load(hf_dir / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        gguf_name = f"{table.get_name(module)}.{suffix}"
        values = tensor.to(torch.float32).numpy()
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            values = values + np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        out[gguf_name] = np.ascontiguousarray(values)
    return out


def _type_of(name: str, values: np.ndarray, qtype: str, mixed: bool) -> str:
    if values.ndim == 1:
        return "F32"
    if mixed:
        return next((t for part, t in MIXED.items() if part in name), "Q4_K")
    return qtype


def _encode(values: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name == "F32":
        return values, None
    qtype = GGMLQuantizationType[type_name]
    if type_name in ENCODERS:
        return ENCODERS[type_name](values), qtype
    return quantize(values, qtype), qtype


def _add_tokenizer(writer: Any, config: dict[str, Any], template: str) -> None:
    tokens, types = tokenizer_tokens(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(template)
