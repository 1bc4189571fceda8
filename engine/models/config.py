"""`ModelConfig`: one normalized record of a checkpoint's architecture, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core.model_files import ModelLoadError
from policy.errors import UserError

SUPPORTED_MODEL_TYPES = ("opt", "llama", "mistral", "qwen2")


class UnsupportedModelError(UserError):
    """The checkpoint's architecture is not one nanoflex implements."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts the layer-wise implementation needs; nothing else."""

    model_type: str
    """'opt' or a Llama-family type ('llama', 'mistral', 'qwen2')."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    activation: str = "silu"
    enable_bias: bool = True

    @property
    def is_opt(self) -> bool:
        return self.model_type == "opt"

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Normalize a transformers `PretrainedConfig` (v4 or v5 field names)."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; nanoflex runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            bos_token_id=hf.bos_token_id,
        )
        if model_type == "opt":
            return cls(
                **common,
                intermediate_size=hf.ffn_dim,
                num_kv_heads=hf.num_attention_heads,
                head_dim=hf.hidden_size // hf.num_attention_heads,
                norm_eps=1e-5,
                do_layer_norm_before=hf.do_layer_norm_before,
                word_embed_proj_dim=hf.word_embed_proj_dim or hf.hidden_size,
                activation=hf.activation_function,
                enable_bias=getattr(hf, "enable_bias", True),
            )
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        attention_bias = bool(getattr(hf, "attention_bias", False))
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"activation {hf.hidden_act!r} is not supported")
        return cls(
            **common,
            intermediate_size=hf.intermediate_size,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling={**rope, "rope_type": rope_type},
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
        )


def read_hf_config(model_dir: Path) -> Any:
    """The checkpoint's transformers `PretrainedConfig`."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config in {model_dir}: {e}") from e
