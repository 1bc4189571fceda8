"""What is being served: `ModelSpec` (shapes and byte sizes of a model) and `WorkloadSpec`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from base.errors import UserError
from policy.errors import ModelSpecError
from policy.hybrid import StateShape
from policy.vision import DEFAULT_IMAGE_PIXELS, VisionSpec

ARCHS: tuple[str, str] = ("opt", "llama")
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
GROUP_SIZE = 64
"""Group-wise 4-bit quantization: one (scale, min) pair per 64 elements."""


def compressed_bytes_per_element(dtype_bytes: int) -> float:
    """4 bits per element plus a (scale, min) pair in the model dtype per group."""
    return 0.5 + 2 * dtype_bytes / GROUP_SIZE  # fp16: 0.5625 B = 0.28x of 2 B


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer, enough to size every tensor the engine moves.

    Byte sizes use `dtype_bytes` per element (the checkpoint dtype; compression is
    applied by the cost model, not here).
    """

    name: str
    arch: str
    """'opt' (learned positions, ReLU MLP, biases) or 'llama' (RMSNorm, RoPE, SwiGLU)."""
    num_layers: int
    hidden_size: int
    intermediate_size: int
    """MLP inner width (OPT's ffn_dim)."""
    num_heads: int
    num_kv_heads: int
    """Key/value heads (GQA); equals num_heads for OPT and Llama-2-7b/13b."""
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    """The LM head shares the input embedding matrix."""
    word_embed_dim: int = 0
    """OPT's word_embed_proj_dim; 0 means hidden_size (no projection)."""
    max_position_embeddings: int = 0
    """Rows of OPT's learned position table; 0 for RoPE models."""
    qkv_bias: bool = False
    """q/k/v projections carry biases (OPT, Qwen2)."""
    model_type: str = ""
    """The transformers model_type it has the shapes of ('': the arch's own, 'opt' or 'llama')."""
    num_norms: int = 2
    """Hidden-wide RMSNorms per layer: 2, or 4 in Gemma (before and after attention and MLP)."""
    qk_norm_params: int = 0
    """Per layer, the q and k norms' weights: 2 * head_dim per head (Qwen 3, Gemma 3), or
    (heads + kv_heads) * head_dim over whole projections (OLMo 2)."""
    sliding_window: int = 0
    """Keys a local layer's query sees (itself included); 0: no local layers."""
    num_local_layers: int = 0
    """Layers with that window (all: Mistral, Phi-3; every other: Gemma 2; 5 of 6: Gemma 3).
    The engine keeps every token's KV (a page holds all layers), but a local layer reads,
    loads and attends over its window only."""
    num_experts: int = 0
    """Routed experts in each MoE layer (Mixtral's num_local_experts); 0: a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's SwiGLU MLP (Mixtral and OLMoE: their intermediate_size)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert of each MoE layer, which has a sigmoid gate
    (hidden -> 1) of its own (Qwen2-MoE); 0: none."""
    o_bias: bool = False
    """The output projection has a bias too (gpt-oss)."""
    attention_sinks: bool = False
    """One sink logit per head and layer (gpt-oss)."""
    moe_biases: bool = False
    """The router and each expert's projections have biases (gpt-oss)."""
    mla_attention_params: int = 0
    """Multi-head latent attention (DeepSeek-V3): one layer's attention parameters (latent
    projections and norms, kv_b, o), where the q/k/v/o formula does not hold; 0: not MLA.
    num_kv_heads (1) and head_dim (kv_lora_rank + qk_rope_head_dim) are then the latent KV
    row the engine stores (engine/models/deepseek.py)."""
    values_are_keys: bool = False
    """A token's value row is its key row, stored once (the engine's `KVShape`: MLA's latent
    [c, k_rope] in the absorbed form), so its KV takes kv_dim values per layer, not 2 x."""
    shared_expert_gate: bool = True
    """The shared expert has Qwen2-MoE's sigmoid gate (hidden -> 1); DeepSeek's and GLM's
    shared experts have none."""
    moe_layer_ids: tuple[int, ...] = ()
    """Layers whose MLP is the MoE block; the others have a dense MLP of intermediate_size
    (Qwen MoE's decoder_sparse_step and mlp_only_layers; every layer in Mixtral, OLMoE)."""
    gated_mlp: bool = True
    """The MLPs (dense, routed experts, shared expert) are gated (SwiGLU: gate, up, down);
    False: up and down only (Nemotron-H's squared ReLU)."""
    mlp_bias: bool = False
    """The dense and shared MLPs' projections have biases (Nemotron-H's and Falcon-H1's
    mlp_bias; Nemotron-H's latent projections too)."""
    moe_latent_size: int = 0
    """Nemotron 3 Super: the routed experts run over a latent this wide, projected in from the
    hidden state before them and back out after them (two projections every token of an MoE
    layer runs); 0: the experts run over the hidden state."""
    attention_output_gate: bool = False
    """q_proj also computes a sigmoid gate per head and channel (Qwen3-Next, Qwen3.5): twice
    as wide."""
    state_layer_ids: tuple[int, ...] = ()
    """Hybrids: layers whose token mixer keeps a fixed-size state per sequence (Gated
    DeltaNet, Mamba-2) instead of attention over KV (policy/hybrid.py)."""
    state: StateShape | None = None
    """The state layers' shapes; None without state layers."""
    mlp_only_layer_ids: tuple[int, ...] = ()
    """Nemotron-H: layers that are an MLP alone (no token mixer), dense or MoE; where there are
    any, the other layers are a token mixer alone (no MLP)."""
    parallel_hybrid: bool = False
    """Falcon-H1: every state layer also runs attention over KV beside its state mixer (the
    two outputs summed), then an MLP; False: a state layer has no attention."""
    pooling: str = ""
    """'' (generates), 'embed' or 'score': a decoder pooling model (engine/executor/pooler.py),
    whose head is the final norm alone (an embedder) or with a one-row classifier (a
    reranker) instead of the (vocab, hidden) LM head; its requests are a prefill only."""
    vision: VisionSpec | None = None
    """A vision-language model's vision tower (policy/vision.py), resident on the compute
    device beside the layers, which every other field describes; None: a text model."""

    def __post_init__(self) -> None:
        if self.pooling not in ("", "embed", "score"):
            raise ModelSpecError(f"pooling must be '', 'embed' or 'score', got {self.pooling!r}")
        if self.arch not in ARCHS:
            raise ModelSpecError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_heads", "head_dim", "vocab_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not self.model_type:  # the arch's own model type
            object.__setattr__(self, "model_type", self.arch)
        if not 0 <= self.num_local_layers <= self.num_layers:
            raise ModelSpecError(f"num_local_layers must be in [0, {self.num_layers}]")
        if self.state is not None and self.num_local_layers:
            raise ModelSpecError("a hybrid's attention layers have no sliding windows")
        if self.num_local_layers and self.sliding_window < 1:
            raise ModelSpecError("local layers need a sliding_window >= 1")
        self._check_experts()
        self._check_layer_kinds()

    def _check_layer_kinds(self) -> None:
        for name in ("state_layer_ids", "mlp_only_layer_ids"):
            ids = tuple(sorted(set(getattr(self, name))))
            object.__setattr__(self, name, ids)
            if not all(0 <= i < self.num_layers for i in ids):
                raise ModelSpecError(f"{name} must be layers in [0, {self.num_layers})")
        if set(self.state_layer_ids) & set(self.mlp_only_layer_ids):
            raise ModelSpecError("a layer cannot be both a state layer and an MLP-only layer")
        if bool(self.state_layer_ids) != (self.state is not None):
            raise ModelSpecError("state layers and their shape (state) come together")
        if self.parallel_hybrid and self.state is None:
            raise ModelSpecError("a parallel hybrid needs state layers")
        if self.num_kv_layers < 1:
            raise ModelSpecError("a model needs at least one attention layer")

    def _check_experts(self) -> None:
        object.__setattr__(self, "moe_layer_ids", tuple(sorted(set(self.moe_layer_ids))))
        if not self.num_experts:
            if self.moe_layer_ids or self.num_experts_per_tok:
                raise ModelSpecError("MoE layers or experts per token need num_experts >= 1")
            return
        if self.arch != "llama":
            raise ModelSpecError("routed experts are SwiGLU MLPs: arch must be 'llama'")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelSpecError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise ModelSpecError("an MoE model needs moe_intermediate_size >= 1")
        if self.moe_latent_size < 0:
            raise ModelSpecError(f"moe_latent_size must be >= 0, got {self.moe_latent_size}")
        if not self.moe_layer_ids or not all(0 <= i < self.num_layers for i in self.moe_layer_ids):
            raise ModelSpecError(f"moe_layer_ids must be layers in [0, {self.num_layers})")

    # ---- parameter counts (elements) -------------------------------------------------

    @property
    def attention_params(self) -> int:
        """Parameters of one layer outside its MLP: q, k, v, o projections (and biases), norms."""
        if self.mla_attention_params:
            return self.mla_attention_params + self.num_norms * self.hidden_size
        h, q_dim, kv_dim = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.attention_output_gate:  # q_proj's second half: the gate
            attention += h * q_dim
        if self.arch == "opt":  # q,k,v,o biases; two LayerNorms (weight and bias)
            return attention + (q_dim + 2 * kv_dim + h) + 4 * h
        bias = (q_dim + 2 * kv_dim if self.qkv_bias else 0) + (h if self.o_bias else 0)
        sinks = self.num_heads if self.attention_sinks else 0
        return attention + bias + sinks + self.num_norms * h + self.qk_norm_params

    @property
    def dense_mlp_params(self) -> int:
        """The MLP of a layer without experts: OPT's fc1, fc2 with biases, SwiGLU's gate,
        up (h -> f) and down (f -> h), or Nemotron-H's up and down."""
        h, f = self.hidden_size, self.intermediate_size
        if self.arch == "opt":
            return 2 * h * f + f + h
        return self._mlp_params(h, f, self.mlp_bias)

    def _mlp_params(self, width: int, inner: int, bias: bool) -> int:
        """One MLP from `width` through `inner` and back: gate (when gated), up and down, with
        their biases where `bias` says."""
        matrices = 3 if self.gated_mlp else 2
        return matrices * width * inner + ((matrices - 1) * inner + width if bias else 0)

    @property
    def expert_input_dim(self) -> int:
        """The width a routed expert reads and writes: the latent (Nemotron 3 Super), else
        the hidden state."""
        return self.moe_latent_size or self.hidden_size

    @property
    def expert_params(self) -> int:
        """One routed expert: a SwiGLU MLP (Nemotron-H: up and down) of width
        moe_intermediate_size (0 when dense) over `expert_input_dim`, with gpt-oss's biases."""
        return self._mlp_params(self.expert_input_dim, self.moe_intermediate_size, self.moe_biases)

    @property
    def moe_always_params(self) -> int:
        """The parts of an MoE block every token uses: the router (hidden -> num_experts), the
        shared expert with its sigmoid gate (hidden -> 1) where it has one, and the projections
        into and out of the experts' latent where they have one."""
        h, shared, latent = self.hidden_size, self.shared_expert_intermediate_size, 0
        gate = h if self.shared_expert_gate else 0
        router = (h + 1 if self.moe_biases else h) * self.num_experts
        if self.moe_latent_size:
            latent = 2 * h * self.moe_latent_size
            latent += self.moe_latent_size + h if self.mlp_bias else 0
        shared_params = self._mlp_params(h, shared, self.mlp_bias) + gate if shared else 0
        return router + shared_params + latent

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def moe_layer_share(self) -> float:
        """Share of the layers that are MoE layers (1 for Mixtral, Qwen3-MoE, OLMoE)."""
        return self.num_moe_layers / self.num_layers

    @property
    def expert_layer_params(self) -> int:
        """Routed expert parameters in one MoE layer: all num_experts of them."""
        return self.num_experts * self.expert_params

    @property
    def total_expert_params(self) -> int:
        """Routed expert parameters of the whole model."""
        return self.num_moe_layers * self.expert_layer_params

    # ---- layer kinds (hybrids) ---------------------------------------------------------

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a per-sequence state instead of KV (policy/hybrid.py)."""
        return self.state is not None

    @property
    def num_state_layers(self) -> int:
        return len(self.state_layer_ids)

    @property
    def num_kv_layers(self) -> int:
        """Layers with attention over KV: all but the state and MLP-only layers (a parallel
        hybrid's state layers have KV too)."""
        state = 0 if self.parallel_hybrid else self.num_state_layers
        return self.num_layers - state - len(self.mlp_only_layer_ids)

    @property
    def kv_layer_share(self) -> float:
        """Share of the layers with KV (1 for a transformer; Qwen3-Next's 12 of 48)."""
        return self.num_kv_layers / self.num_layers

    @property
    def state_layer_share(self) -> float:
        return self.num_state_layers / self.num_layers

    @property
    def state_bytes_per_layer(self) -> int:
        """One sequence's state in one state layer (0 without state layers)."""
        return self.state.bytes_per_sequence(self.dtype_bytes) if self.state else 0

    @property
    def state_bytes_per_sequence(self) -> int:
        """One sequence's state over every state layer (Qwen3-Next-80B-A3B in bfloat16: 36
        layers of 2 MiB + 48 KiB, 73.7 MiB)."""
        return self.num_state_layers * self.state_bytes_per_layer

    def _mixers_params(self) -> int:
        """Parameters of every layer's token mixer and norms, outside the MLPs (a parallel
        hybrid's layer: attention with its norms and the state mixer beside it)."""
        norms = self.num_norms * self.hidden_size
        state = 0
        if self.state is not None:
            own_norms = 0 if self.parallel_hybrid else norms  # else counted with attention
            state = self.num_state_layers * (self.state.mixer_params + own_norms)
        return (
            self.num_kv_layers * self.attention_params
            + state
            + len(self.mlp_only_layer_ids) * norms
        )

    def _mlps_params(self, routed_per_layer: float) -> float:
        """Parameters of every layer's MLP, each MoE layer's routed experts counted as
        `routed_per_layer`; Nemotron-H's MLP-only layers are its only MLPs."""
        num_mlps = len(self.mlp_only_layer_ids) or self.num_layers
        dense = (num_mlps - self.num_moe_layers) * self.dense_mlp_params
        return dense + self.num_moe_layers * (self.moe_always_params + routed_per_layer)

    @property
    def layers_params(self) -> int:
        """Parameters of all layers, every routed expert counted."""
        return self._mixers_params() + round(self._mlps_params(self.expert_layer_params))

    @property
    def layer_params(self) -> float:
        """Parameters in one transformer layer: attention, MLP, norms (and biases); averaged
        over the layers, every routed expert counted (an int for a dense transformer)."""
        if not self.is_moe and not self.is_hybrid:
            return self.attention_params + self.dense_mlp_params
        return self.layers_params / self.num_layers

    @property
    def active_layer_params(self) -> float:
        """Parameters one token computes with in one layer, averaged over the layers: in an
        MoE layer attention, router, shared expert and num_experts_per_tok routed experts."""
        if not self.is_moe:
            return self.layer_params
        routed = self.num_experts_per_tok * self.expert_params
        return (self._mixers_params() + self._mlps_params(routed)) / self.num_layers

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: the layers' active ones plus embeddings and
        head (Mixtral-8x7B: 12.9B of 46.7B)."""
        return round(self.active_layer_params * self.num_layers) + self.embedding_params

    @property
    def embedding_params(self) -> int:
        """Parameters outside the layers: token (+position) embeddings, final norm, LM head."""
        embed_dim = self.word_embed_dim or self.hidden_size
        params = self.vocab_size * embed_dim
        if embed_dim != self.hidden_size:  # OPT-350m project_in / project_out
            params += 2 * embed_dim * self.hidden_size
        params += self.max_position_embeddings * self.hidden_size
        params += 2 * self.hidden_size if self.arch == "opt" else self.hidden_size
        if self.pooling or not self.tie_word_embeddings:
            params += self.head_rows * embed_dim
        return params

    @property
    def head_rows(self) -> int:
        """Rows of the head's matrix: the vocabulary's, or a pooling head's (0 or 1)."""
        return {"": self.vocab_size, "embed": 0, "score": 1}[self.pooling]

    @property
    def head_width(self) -> int:
        """Values the head gives per row (float32): the logits, a pooled vector, a score."""
        return {"": self.vocab_size, "embed": self.hidden_size, "score": 1}[self.pooling]

    @property
    def total_params(self) -> int:
        return self.layers_params + self.embedding_params

    # ---- byte sizes ------------------------------------------------------------------

    @property
    def kv_dim(self) -> int:
        """Width of one of k or v per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weight_bytes(self) -> float:
        """Bytes of one transformer layer's weights (FlexGen's 8*h1^2 + 4*h1*h2 for OPT fp16),
        averaged over the layers, every routed expert counted."""
        return self.layer_params * self.dtype_bytes

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of one routed expert (the unit the engine places and loads)."""
        return self.expert_params * self.dtype_bytes

    @property
    def embedding_weight_bytes(self) -> int:
        return self.embedding_params * self.dtype_bytes

    @property
    def total_weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_row_dim(self) -> int:
        """Values of one token's KV in one layer: k and v (2 * kv_dim), or k alone where the
        values are the keys (`values_are_keys`)."""
        return self.kv_dim if self.values_are_keys else 2 * self.kv_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """k and v of one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes (GQA;
        half that where the values are the keys)."""
        return self.kv_row_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV over the attention layers (a hybrid's state layers have none)."""
        return self.num_kv_layers * self.kv_bytes_per_token_per_layer

    def attended_len(self, length: float) -> float:
        """Keys a decode at context `length` attends over, averaged over the attention layers:
        a local layer reads at most its window."""
        local, layers = self.num_local_layers, self.num_kv_layers
        window = min(length, float(self.sliding_window)) if local else length
        return ((layers - local) * length + local * window) / layers

    def attention_pairs(self, length: float) -> float:
        """Causal query-key pairs of a prefill of `length` tokens, averaged over the attention
        layers (length^2 / 2 for a global layer; a local one stops at its window)."""
        full = length * length / 2
        if not self.num_local_layers or length <= self.sliding_window:
            return full
        w = float(self.sliding_window)
        local = w * w / 2 + (length - w) * w
        num_global = self.num_kv_layers - self.num_local_layers
        return (num_global * full + self.num_local_layers * local) / self.num_kv_layers

    @property
    def hidden_bytes_per_token(self) -> int:
        """One token's activation between layers: hidden_size * dtype_bytes."""
        return self.hidden_size * self.dtype_bytes

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face `config.json` dict (policy/hf_spec.py lists the families)."""
        from policy.hf_spec import spec_fields

        return cls(**spec_fields(config, name))


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of the work: prompt and generation lengths in tokens (means allowed), and a
    vision model's images per prompt."""

    prompt_len: float
    """Text tokens of a prompt (a vision model's image tokens come on top: `prompt_tokens`)."""
    gen_len: float
    images_per_request: float = 0.0
    """Images in each prompt (a mean allowed); each runs through the vision tower and adds
    its tokens to the prompt. Unused for a text model."""
    pixels_per_image: float = DEFAULT_IMAGE_PIXELS
    """Pixels of each image (1024 x 1024 unless given)."""

    def __post_init__(self) -> None:
        if not self.prompt_len >= 1:
            raise UserError(f"prompt length must be >= 1 token, got {self.prompt_len}")
        if not self.gen_len >= 1:
            raise UserError(f"generation length must be >= 1 token, got {self.gen_len}")
        if not self.images_per_request >= 0:
            raise UserError(f"images per request must be >= 0, got {self.images_per_request}")
        if not self.pixels_per_image >= 1:
            raise UserError(f"pixels per image must be >= 1, got {self.pixels_per_image}")

    def priced_for(self, model: ModelSpec) -> WorkloadSpec:
        """The workload as `model` runs it: a pooling model's requests are a prefill only,
        priced as generating 1 token (its last position's head row is the answer; no decode
        step, no KV beyond the prompt's, freed when the prefill ends)."""
        return dataclasses.replace(self, gen_len=1) if model.pooling else self

    def image_tokens(self, model: ModelSpec) -> float:
        """Tokens of a prompt's images in `model`'s prompt; 0 for a text model."""
        if model.vision is None:
            return 0.0
        return self.images_per_request * model.vision.tokens_per_image(self.pixels_per_image)

    def prompt_tokens(self, model: ModelSpec) -> float:
        """Tokens of a whole prompt as `model` runs it: text and image tokens, all with KV."""
        return self.prompt_len + self.image_tokens(model)

    @property
    def total_len(self) -> float:
        """Tokens per sequence at the end: prompt_len + gen_len."""
        return self.prompt_len + self.gen_len
