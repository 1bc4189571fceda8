"""A transformers config -> `ModelConfig` fields, by the family's row (policy/families.py); what
the layer code does not honour is refused by name.

Every field transformers' config class defines is accounted for: a family's reader reads the
fields its row says it honours, a few never change the numbers (`HARMLESS`: ids, dtypes,
dropout, bookkeeping), and any other field whose value differs from the class's default is one
the layer code would silently ignore, so loading stops with its name. A new transformers field
or a bidirectional Gemma fails this way instead of giving wrong tokens. Keys the class does not
define are ignored, as transformers' model ignores them (leftovers of remote code, such as
Phi-4-mini's `full_attn_mod`), except the ones that change the weights (`REFUSED`).
"""

from __future__ import annotations

import logging
from typing import Any

from base.errors import UserError
from engine.models.quant_config import Fp8ConfigError, fp8_block_size, is_mxfp4
from engine.models.registry import reader_of
from policy.families import FAMILIES

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
"""The model types nanoflex runs, in the order the family table lists them."""

REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2's softmax group-limited routing (nanoflex routes as V3 does)",
}
"""Mixture-of-experts types refused by name, with what nanoflex does not implement of each."""


log = logging.getLogger("nanoflex.engine")


class UnsupportedModelError(UserError):
    """The checkpoint's architecture, or a setting in its config, is not one nanoflex
    implements."""


HARMLESS = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "name_or_path",
        "_model_name_or_path",
        "use_cache",
        "initializer_range",
        "init_std",
        "initializer_factor",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "id2label",
        "label2id",
        "tokenizer_class",
        "prefix",
        "cache_implementation",
        "pretraining_tp",  # Llama 2's sharded MLP: the same products, summed in pieces
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_remove_final_layer_norm",  # OPT conversion bookkeeping
        "unk_token_id",
    }
)
"""Config fields that never change the numbers (besides dropout, which inference skips)."""
REFUSED = frozenset({"quantization_config"})
"""Keys outside the config class that change what the weights mean."""

TEXT_CONFIGS = {t: row.text_config for t, row in FAMILIES.items() if row.is_vision_wrapper}
"""Model types of checkpoints with a vision tower nanoflex does not run (Llama 4, Qwen3.5 as
published) -> their language model's type."""


def model_config_fields(hf: Any) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for the transformers config `hf`."""
    model_type = getattr(hf, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: nanoflex does not implement "
            f"{REFUSED_MODEL_TYPES[model_type]}; its mixture-of-experts families are "
            "mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek_v3 and gpt_oss"
        )
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; nanoflex runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    if FAMILIES[model_type].is_vision_wrapper:  # one checkpoint with a vision tower
        text = _text_config(hf)
        fields = _read(text)
        # the whole checkpoint's head is tied (or not) as the wrapper says, as transformers'
        # ...ForConditionalGeneration that saved it tied it
        tied = getattr(hf, "tie_word_embeddings", None)
        if tied is not None:
            fields["tie_word_embeddings"] = bool(tied)
        log.info(
            "%s: the vision tower is not loaded; nanoflex runs its %s language model on text",
            model_type,
            text.model_type,
        )
        return fields
    return _read(hf)


def _read(hf: Any) -> dict[str, Any]:
    """The fields its family's reader reads of `hf`, after refusing what that reader does not
    honour (a reader whose row honours None refuses by itself)."""
    honoured = FAMILIES[hf.model_type].honoured
    if honoured is not None:
        refuse_unhonoured(hf, honoured)
    fields: dict[str, Any] = reader_of(hf.model_type)(hf)
    return fields


def _text_config(hf: Any) -> Any:
    """The language model's config of a checkpoint with a vision tower: nanoflex runs its text
    (the image tokens are ordinary vocabulary it never sees in a text prompt)."""
    text = getattr(hf, "text_config", None)
    if text is None or getattr(text, "model_type", None) != TEXT_CONFIGS[hf.model_type]:
        raise UnsupportedModelError(
            f"a {hf.model_type} config without a {TEXT_CONFIGS[hf.model_type]} text_config is "
            "not supported"
        )
    return text


def refuse_unhonoured(hf: Any, honoured: frozenset[str]) -> None:
    """Raise `UnsupportedModelError` naming the first field of `hf` that is neither honoured,
    harmless, nor at its default value."""
    defaults = _defaults(type(hf))
    for key, value in hf.to_dict().items():
        if key in honoured or key in HARMLESS or "dropout" in key or key.endswith("pdrop"):
            continue
        if key == "quantization_config" and _is_fp8(hf.model_type, value):
            continue  # dequantized at load (engine/loading/fp8.py)
        if key == "quantization_config" and hf.model_type == "gpt_oss" and is_mxfp4(value):
            continue  # its experts dequantized at load (engine/loading/mxfp4.py)
        if key == "layerdrop" or (key in defaults and defaults[key] == value):
            continue
        if defaults and key not in defaults and key not in REFUSED:
            continue  # transformers' model never reads it either
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UnsupportedModelError(
            f"{hf.model_type} config field {key}={shown} is not supported: nanoflex does not "
            "implement it, and running without it would give other tokens than the model's"
        )


def _is_fp8(model_type: str, quantization: Any) -> bool:
    """The checkpoint is block-scaled FP8 that nanoflex dequantizes at load; False for no
    quantization or another method (refused as any unhonoured field); an FP8 variant it
    does not read is refused here by name."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return False
    try:
        fp8_block_size(quantization)
    except Fp8ConfigError as e:
        raise UnsupportedModelError(f"{model_type}: {e} is not supported") from e
    return True


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(config_class: type) -> dict[str, Any]:
    """The fields of a default instance of `config_class` (made once per class)."""
    if config_class not in _DEFAULTS:
        try:
            _DEFAULTS[config_class] = dict(config_class().to_dict())
        except (TypeError, ValueError):  # a class with required fields: every field counts
            _DEFAULTS[config_class] = {}
    return _DEFAULTS[config_class]


def require(hf: Any, key: str, allowed: tuple[Any, ...]) -> Any:
    """hf.key, refused by name unless one of `allowed`."""
    value = getattr(hf, key, None)
    if value not in allowed:
        raise UnsupportedModelError(
            f"{hf.model_type} config field {key}={value!r} is not supported (nanoflex "
            f"implements {', '.join(map(repr, allowed))})"
        )
    return value


# -- readers -------------------------------------------------------------------------------
