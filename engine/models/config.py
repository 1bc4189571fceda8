"""`ModelConfig`: one normalized record of a checkpoint's architecture, read from its HF config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core.model_files import ModelLoadError
from engine.models.hf_config import model_config_fields


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts the layer-wise implementation needs; nothing else."""

    model_type: str
    """'opt' or a Llama-family type (`SUPPORTED_MODEL_TYPES`; a Gemma 3 checkpoint with a vision
    tower is read as its language model, 'gemma3_text')."""
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
    """The global layers' rotary scaling: {'rope_type': 'default' | 'linear' | 'llama3' |
    'longrope', and that type's parameters}."""
    rotary_dim: int = 0
    """Dimensions of each head that rotate (Phi's partial rotary: the first ones); 0: all."""
    nope_layers: tuple[int, ...] = ()
    """Decoder layers (0-based) whose q and k are not rotated (SmolLM3's NoPE layers)."""
    local_rope_theta: float = 0.0
    """Gemma 3: the rotary base of the sliding-window layers (default scaling); 0: the
    global one."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple[int, ...] = ()
    """Per decoder layer, its sliding window (a query sees that many keys, itself
    included); 0: the layer sees every key. Empty: no layer has one."""
    attn_scale: float | None = None
    """Attention scores' scale (Gemma's query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5."""
    attn_softcap: float = 0.0
    """Gemma 2: scores become softcap * tanh(scores / softcap) before the mask; 0: none."""
    logit_softcap: float = 0.0
    """Gemma 2/3: the same on the final logits; 0: none."""
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    activation: str = "silu"
    """The MLP's activation: 'relu' (OPT), 'silu' (SwiGLU) or 'gelu_pytorch_tanh' (Gemma's
    GeGLU)."""
    enable_bias: bool = True
    # Mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE)
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top-k)."""
    moe_intermediate_size: int = 0
    """Each routed expert's SwiGLU width."""
    norm_topk_prob: bool = False
    """The top-k router weights are renormalised to sum to 1 (Mixtral always does)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: the width of the shared expert every token also runs, scaled by a sigmoid
    gate; 0: none."""
    dense_layers: tuple[int, ...] = ()
    """Decoder layers (0-based) of an MoE model with a dense MLP of `intermediate_size`
    instead of experts (Qwen's `mlp_only_layers` and `decoder_sparse_step`, DeepSeek's and
    GLM's `first_k_dense_replace`)."""
    num_expert_groups: int = 1
    """DeepSeek-V3's and GLM-4.5's grouped routing: the groups the experts are split into
    (n_group)."""
    num_groups_per_tok: int = 1
    """Grouped routing: the groups a token's experts are chosen from (topk_group)."""
    routed_scaling_factor: float = 1.0
    """Grouped routing: the routed experts' weights are multiplied by it."""

    swiglu_alpha: float = 0.0
    """gpt-oss's experts: the clamped SwiGLU's sigmoid slope (0: not gpt-oss)."""
    swiglu_limit: float = 0.0
    """gpt-oss's experts: gate clamped above, up within +-limit."""
    # Multi-head latent attention (DeepSeek-V3, engine/models/deepseek.py)
    kv_lora_rank: int = 0
    """Width of the compressed latent each token's keys and values come from; 0: not MLA.
    With MLA the KV row is one head of kv_lora_rank + rotary_dim (`head_dim`)."""
    qk_nope_head_dim: int = 0
    """MLA: each head's query and key width outside the rotary part."""
    v_head_dim: int = 0
    """MLA: each head's value width."""
    rope_interleave: bool = False
    """MLA: the rotary pairs are interleaved (DeepSeek-V3's checkpoints)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Decoder layer `layer` (0-based) routes its tokens to experts."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def is_opt(self) -> bool:
        return self.model_type == "opt"

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Decoder layer `layer`'s (0-based) sliding window; 0: none."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the decoder layers, in layer order (0: full attention)."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

    @property
    def shared_window(self) -> int:
        """The window every layer has (Mistral, Phi-3): then no layer reads keys older than it,
        and a sequence's past is cut to it; 0 where any layer sees every key."""
        return self.windows[0] if len(self.windows) == 1 else 0

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Normalize a transformers `PretrainedConfig` (v4 or v5 field names); a field the
        implementation does not honour is refused by name (`engine.models.hf_config`)."""
        return cls(**model_config_fields(hf))


SAME_ARCHITECTURE = {"kimi_k2": "deepseek_v3"}
"""Model types whose checkpoints are another type's architecture under a name transformers
does not know (Kimi K2: DeepSeek-V3's, its config and modeling classes named by `auto_map`
as remote code): read with that type's own config class."""


def read_hf_config(model_dir: Path) -> Any:
    """The checkpoint's transformers `PretrainedConfig` (Kimi K2's as DeepSeek-V3's)."""
    from transformers import AutoConfig

    try:
        config_path = model_dir / "config.json"
        if config_path.is_file():
            model_type = json.loads(config_path.read_text()).get("model_type")
            if model_type in SAME_ARCHITECTURE:
                same = SAME_ARCHITECTURE[model_type]
                hf = type(AutoConfig.for_model(same)).from_pretrained(model_dir)
                hf.model_type = same  # type: ignore[misc]  # else the file's name stays
                return hf
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config in {model_dir}: {e}") from e
