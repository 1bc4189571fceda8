"""A GGUF file's metadata -> a transformers config, for the families whose metadata transformers'
GGUF reader leaves out or cannot read: Qwen 3's head size, Gemma 2's soft-caps and score
scale, Gemma 3's window pattern, local rotary base and rope scaling, Phi-3's partial rotary,
window and LongRoPE factors, OLMo 2 at all.

Keys are the ones llama.cpp's converter writes (`<arch>.attention.head_count`, ...). Where
llama.cpp's runtime assumes a value no key states (src/llama-model.cpp: Gemma's window pattern
and query scale by model size, Gemma 3's local rotary base), the same value is assumed here,
so the converted model computes what llama.cpp computes from the same file. A rotary scaling
the file asks for and nanoflex does not implement is refused by name.
"""

from __future__ import annotations

from typing import Any

from engine.core.model_files import ModelLoadError
from engine.loading.gguf_tensors import GgufTensors
from engine.models.hf_config import UnsupportedModelError

MODEL_TYPES = {
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "olmo2": "olmo2",
}
"""GGUF architectures read here -> transformers model type (Llama and Qwen 2: transformers)."""
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""llama.cpp scales the 27B models' queries by (hidden / heads) ** -0.5, the others' by
head_dim ** -0.5; it knows them by their number of layers."""


class Metadata:
    """`<arch>.<key>` fields of a GGUF file, as Python values."""

    def __init__(self, tensors: GgufTensors) -> None:
        self.arch = tensors.architecture
        self.path = tensors.path
        self._fields = tensors.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, or `key` itself when it names another namespace (tokenizer.*)."""
        name = key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}"
        field = self._fields.get(name)
        return default if field is None else field.contents()

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} lacks the metadata key {self.arch}.{key}")
        return value


def gguf_config(tensors: GgufTensors) -> Any:
    """The transformers config of the GGUF file behind `tensors` (architecture in MODEL_TYPES)."""
    from transformers import AutoConfig

    meta = Metadata(tensors)
    names = tensors.tensor_names()
    fields = _common(meta, tensors, names)
    fields.update(_FAMILY[meta.arch](meta, tensors, fields))
    return AutoConfig.for_model(MODEL_TYPES[meta.arch], **fields)


def _common(meta: Metadata, tensors: GgufTensors, names: set[str]) -> dict[str, Any]:
    hidden, heads = int(meta["embedding_length"]), int(meta["attention.head_count"])
    return dict(
        vocab_size=tensors.raw_shape("token_embd.weight")[0],
        hidden_size=hidden,
        intermediate_size=int(meta["feed_forward_length"]),
        num_hidden_layers=int(meta["block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta["attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["context_length"]),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _rope(meta: Metadata, theta_key: str = "rope.freq_base") -> dict[str, Any]:
    """transformers' rope parameters for the file's rotary base and scaling (none or linear)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(theta_key, 1e4))}
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(meta["rope.scaling.factor"]))
    elif kind != "none":
        raise UnsupportedModelError(
            f"{meta.path.name} asks for rope scaling {kind!r}, which nanoflex does not convert "
            "from GGUF (it reads none and linear)"
        )
    return rope


def _qwen3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    bias = "blk.0.attn_q.bias" in tensors.tensor_names()
    return dict(rope_parameters=_rope(meta), attention_bias=bias)


def _olmo2(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    return dict(rope_parameters=_rope(meta))


def _query_pre_attn_scalar(meta: Metadata, fields: dict[str, Any]) -> int:
    if fields["num_hidden_layers"] == GEMMA_27B_LAYERS[meta.arch]:
        return int(fields["hidden_size"] // fields["num_attention_heads"])
    return int(fields["head_dim"])


def _gemma2(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Every other layer local (transformers' default pattern and llama.cpp's), window 4096 and
    caps 50 / 30 where the file does not say (llama.cpp's defaults)."""
    return dict(
        rope_parameters=_rope(meta),
        query_pre_attn_scalar=_query_pre_attn_scalar(meta, fields),
        sliding_window=int(meta.get("attention.sliding_window", 4096)),
        attn_logit_softcapping=float(meta.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(meta.get("final_logit_softcapping", 30.0)),
    )


def _gemma3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Local layers only where the file has a window (llama.cpp), every sixth layer global
    unless the file gives a pattern, local rotary base 10000 unless given."""
    window = int(meta.get("attention.sliding_window", 0))
    num_layers = fields["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if not window:
        local = [False] * num_layers
    elif isinstance(pattern, list):  # per layer: True where it is local
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    softcap = meta.get("final_logit_softcapping")
    return dict(
        rope_parameters={
            "full_attention": _rope(meta),
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0)),
            },
        },
        query_pre_attn_scalar=_query_pre_attn_scalar(meta, fields),
        sliding_window=window or None,
        layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _phi3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary from the rotated dimensions; LongRoPE from the factor tensors llama.cpp
    writes for it; a window of 0 means none (Phi-4)."""
    rope = _rope(meta)
    rotated = int(meta.get("rope.dimension_count", fields["head_dim"]))
    rope["partial_rotary_factor"] = rotated / fields["head_dim"]
    original = int(
        meta.get("rope.scaling.original_context_length", fields["max_position_embeddings"])
    )
    if "rope_factors_long.weight" in tensors.tensor_names():
        rope.update(
            rope_type="longrope",
            long_factor=tensors.raw("rope_factors_long.weight").tolist(),
            short_factor=tensors.raw("rope_factors_short.weight").tolist(),
            original_max_position_embeddings=original,
        )
        if meta.get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(meta["rope.scaling.attn_factor"])
    return dict(
        rope_parameters=rope,
        original_max_position_embeddings=original,
        sliding_window=int(meta.get("attention.sliding_window", 0)) or None,
    )


_FAMILY = {"qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "olmo2": _olmo2}
