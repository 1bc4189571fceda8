"""`ModelConfig`: one normalized record of a checkpoint's architecture, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from engine.core.model_files import ModelLoadError
from engine.models.hf_config import model_config_fields
from engine.models.multipliers import Multipliers
from engine.models.vision_config import VisionConfig
from engine.models.vit_config import ViTConfig
from policy.config_json import read_config_json
from policy.families import ALIASES


class KVShape(NamedTuple):
    """One token's KV row of one layer: its keys (num_kv_heads, head_dim) then its values of
    the same shape, or, where `values_are_keys`, the keys alone, read as the values too."""

    num_kv_heads: int
    head_dim: int
    values_are_keys: bool = False

    @property
    def kv_dim(self) -> int:
        """Width of the keys (or of the values): num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def row_dim(self) -> int:
        """Width of the row: the keys then the values, or the keys alone."""
        return self.kv_dim if self.values_are_keys else 2 * self.kv_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts the layer-wise implementation needs; nothing else."""

    model_type: str
    """'opt' or a Llama-family type (a row of policy/families.py; Llama 4's and Qwen3.5's
    checkpoints with a vision tower are read as their language model, 'llama4_text'...)."""
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
    mrope_section: tuple[int, ...] = ()
    """Qwen2.5-VL's M-RoPE: how many of the rotary frequencies follow each position axis
    (t, h, w), in order; (): one position per token."""
    vision: VisionConfig | ViTConfig | None = None
    """The vision tower's shapes (Qwen2.5-VL's, or a ViT's: Gemma 3); None: a text model."""
    image_token_id: int | None = None
    """The token an image's features replace (with `vision`)."""
    bidirectional_images: bool = False
    """Gemma 3: the tokens of one image attend to each other both ways in the prefill (the
    rest stays causal), so no prefill chunk ends inside an image (`SeqMedia.whole_images`)."""
    nope_layers: tuple[int, ...] = ()
    """Decoder layers (0-based) whose q and k are not rotated (SmolLM3's NoPE layers)."""
    local_rope_theta: float = 0.0
    """Gemma 3: the rotary base of the sliding-window layers (default scaling); 0: the
    global one."""
    qk_l2_norm: bool = False
    """Llama 4: q and k of the rotary layers L2-normed per head (no weight) after the rotary."""
    attn_floor_scale: float = 0.0
    """Llama 4's attention temperature tuning: a NoPE layer's queries at position p are scaled
    by log1p(floor((p + 1) / attn_floor_scale)) * attn_temperature_scale + 1; 0: none."""
    attn_temperature_scale: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_windows: tuple[int, ...] = ()
    """Per decoder layer, its sliding window (a query sees that many keys, itself
    included); 0: the layer sees every key; negative: chunked local attention of -w tokens
    (Llama 4: a query at position p sees the keys from p - p % -w to p). Empty: no layer has
    one."""
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

    moe_latent_size: int = 0
    """Nemotron-H: the routed experts run over a latent of this width (projected in before
    them, out after them); 0: over the hidden states."""

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
    # Hybrids (engine/models/qwen3_next.py): Gated DeltaNet layers beside attention layers
    state_layers: tuple[int, ...] = ()
    """Decoder layers (0-based) that mix tokens through a fixed-size per-sequence state (Gated
    DeltaNet) instead of attention over KV pages; empty: a transformer."""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    """Gated DeltaNet: its heads, their widths and the short convolution's kernel length."""
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_dim: int = 0
    mamba_groups: int = 0
    mamba_inner: int = 0
    mamba_chunk: int = 0
    """Mamba-2 state layers (Granite 4 hybrid, engine/models/granite_hybrid.py): heads, each
    head's width, the state's width, the B/C groups, the inner width (heads * head dim) and
    the chunk of the chunked scan; 0 heads: the state layers are Gated DeltaNet."""
    mamba_gate: str = "gate_norm"
    """How Mamba-2's output is gated by SiLU(z) and normed: 'gate_norm' (Granite, Nemotron-H:
    gated, then the grouped RMSNorm, cast back, then scaled), 'gate_norm_f32' (Falcon-H1:
    the same, scaled before the cast), 'norm_gate_f32' (Falcon-H1's mamba_norm_before_gate:
    normed and scaled, then gated, then cast) or 'gate' (Falcon-H1 without mamba_rms_norm:
    gated alone)."""
    parallel_hybrid: bool = False
    """Falcon-H1: every decoder layer runs attention and a Mamba-2 mixer side by side over the
    same normed input and sums their outputs, so each layer is a state layer with KV pages."""
    multipliers: Multipliers = field(default_factory=Multipliers)
    """Falcon-H1's muP multipliers (all 1 elsewhere)."""
    mlp_layers: tuple[int, ...] = ()
    """Nemotron-H: decoder layers (0-based) that are an MLP alone (no token mixer), or, when
    `is_moe_layer`, its 'moe' layers: routed experts of squared ReLU beside shared ones."""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    """Granite's scalings: embeddings times the first, each layer's attention (or mixer) and MLP
    output times the second before the residual add, logits divided by the third."""
    attn_output_gate: bool = False
    """Qwen3-Next and Qwen3.5: each attention head's output is scaled by a sigmoid gate that
    q_proj computes beside the query."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Decoder layer `layer` (0-based) routes its tokens to experts."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def is_hybrid(self) -> bool:
        """Some decoder layers keep a per-sequence state (`state_layers`)."""
        return bool(self.state_layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The decoder layers (0-based) with attention over KV pages, in order (Falcon-H1's
        are all of them, each beside its state)."""
        other = set(self.mlp_layers) | (set() if self.parallel_hybrid else set(self.state_layers))
        return tuple(i for i in range(self.num_layers) if i not in other)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def is_mamba(self) -> bool:
        """The state layers are Mamba-2's (else Gated DeltaNet's)."""
        return self.mamba_num_heads > 0

    @property
    def conv_dim(self) -> int:
        """Channels of a state layer's short convolution: Gated DeltaNet's q, k and v; Mamba-2's
        x, B and C."""
        if self.is_mamba:
            return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state_dim
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        """One state layer's recurrent state per sequence (float32): Gated DeltaNet's (value
        heads, key dim, value dim), Mamba-2's (heads, head dim, state dim)."""
        if self.is_mamba:
            return (self.mamba_num_heads, self.mamba_head_dim, self.mamba_state_dim)
        return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)

    def state_bytes(self, itemsize: int) -> int:
        """Bytes of one sequence's state over every state layer: the convolution window
        (conv_dim x (kernel - 1) in the compute dtype of `itemsize` bytes) and the recurrent
        state (float32, as transformers keeps it)."""
        conv = self.conv_dim * (self.linear_conv_kernel - 1) * itemsize
        heads, rows, cols = self.recurrent_shape
        return len(self.state_layers) * (conv + heads * rows * cols * 4)

    @property
    def is_opt(self) -> bool:
        return self.model_type == "opt"

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def values_are_keys(self) -> bool:
        """A token's value row is its key row, so its KV row holds it once and every reader
        takes the value from the key: multi-head latent attention in the absorbed form
        (deepseek.py), whose one KV head [latent, k_rope] is both."""
        return self.kv_lora_rank > 0

    @property
    def kv_shape(self) -> KVShape:
        """One token's KV row of one layer, as the pages hold it."""
        return KVShape(self.num_kv_heads, self.head_dim, self.values_are_keys)

    def window(self, layer: int) -> int:
        """Decoder layer `layer`'s (0-based) sliding window; 0: none."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the decoder layers, in layer order (0: full attention)."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

    @property
    def shared_window(self) -> int:
        """The sliding window every layer has (Mistral, Phi-3): then no layer reads keys older
        than it, and a sequence's past is cut to it; 0 where any layer sees every key, or
        attends by chunks."""
        return shared_window(self.windows)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Normalize a transformers `PretrainedConfig` (v4 or v5 field names); a field the
        implementation does not honour is refused by name (`engine.models.hf_config`)."""
        return cls(**model_config_fields(hf))


def shared_window(windows: tuple[int, ...]) -> int:
    """The sliding window of every layer, of the distinct `windows` of a model's layers; 0
    where they differ, or where the one they share is none or chunks (negative)."""
    return max(windows[0], 0) if len(windows) == 1 else 0


def read_hf_config(model_dir: Path) -> Any:
    """The checkpoint's transformers `PretrainedConfig` (a type the family table aliases, as Kimi
    K2 to DeepSeek-V3, read with its architecture's config class)."""
    from transformers import AutoConfig

    try:
        config_path = model_dir / "config.json"
        if config_path.is_file():
            model_type = read_config_json(config_path).get("model_type")
            if model_type in ALIASES:  # another type's architecture under its own name
                same = ALIASES[model_type]
                hf = type(AutoConfig.for_model(same)).from_pretrained(model_dir)
                hf.model_type = same  # type: ignore[misc]  # else the file's name stays
                return hf
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config in {model_dir}: {e}") from e
