"""Small GGUF files written the way llama.cpp's converter writes them, from tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2"}
"""Model type of a tiny checkpoint -> the GGUF architecture llama.cpp writes for it."""


def write_gguf(hf_dir: Path, path: Path) -> Path:
    """A float32 GGUF of the checkpoint in `hf_dir` (config.json + model.safetensors): llama.cpp's
    metadata keys and tensor names, q/k rows permuted as llama.cpp does for Llama, no tokenizer."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    writer = GGUFWriter(str(path), arch)
    add_shape_keys(writer, arch, config)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, config["num_hidden_layers"])
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        gguf_name = f"{table.get_name(module)}.{suffix}"
        values = tensor.to(torch.float32).numpy()
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            values = permute_like_llama_cpp(values, heads if ".attn_q." in gguf_name else kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
