"""A Hugging Face `config.json` (a plain dict: no transformers here) -> `ModelSpec` fields.

Shapes only, per family: what the cost model needs to size every tensor the engine moves
(the engine's own reading, engine/models/hf_config.py, decides what runs). Which types it
prices, and as what (a vision checkpoint's language model, an alias, a hybrid, a head tied by
default), the family table says (policy/families.py), for the engine and the planner alike."""

from __future__ import annotations

from typing import Any

from policy.config_json import model_type_of
from policy.errors import ModelSpecError
from policy.families import FAMILIES
from policy.hybrid import MOE_KINDS, hybrid_fields, layer_kinds
from policy.vision import VisionSpec, vision_spec

_GATED_DELTA = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
"""Hybrids of Gated DeltaNet layers beside attention with an output gate and q/k norms."""
HYBRIDS = frozenset(t for t, row in FAMILIES.items() if row.hybrid)
"""Model types with state layers (policy/hybrid.py)."""
_QWEN_SHARED = ("qwen3_next", "qwen3_5_moe_text")
"""Qwen MoE types whose MoE layers have Qwen2-MoE's gated shared expert."""
_PRICED = {t: row for t, row in FAMILIES.items() if not row.text_config}
"""The types the planner prices from their own config.json: every text model."""
_TEXT_MODELS = {t: row.planned_as for t, row in FAMILIES.items() if row.text_config}
"""Vision checkpoints' model types -> their language model's (the vision tower, where
policy/vision.py has a reader for it, is priced beside it: `ModelSpec.vision`)."""
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def spec_fields(config: dict[str, Any], name: str | None) -> dict[str, Any]:
    """`ModelSpec` keyword arguments for `config`; a `ModelSpecError` names what is wrong."""
    model_type = model_type_of(config)
    vision = _vision(config, model_type, name)
    if model_type in _TEXT_MODELS:
        # Gemma 3 4B and larger, Llama 4, Qwen2.5-VL and Qwen3.5 ship with a vision tower:
        # their language model (Qwen2.5-VL's released files keep its fields at the top level)
        dtype = config.get("torch_dtype") or config.get("dtype")
        text = config.get("text_config")
        if not isinstance(text, dict):
            text = config if vision is not None else None
        if text is not None:
            model_type = _TEXT_MODELS[model_type]
            config = {"torch_dtype": dtype, **text, "model_type": model_type}
    row = _PRICED.get(model_type)
    if row is None:
        raise ModelSpecError(f"unsupported model_type {model_type!r}; supported: {sorted(_PRICED)}")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    dtype = dtype.replace("torch.", "")
    if dtype not in _DTYPE_BYTES:
        raise ModelSpecError(f"unsupported torch_dtype {dtype!r} in config")
    label = name or str(config.get("_name_or_path") or model_type)
    try:
        if row.arch == "opt":
            return _opt(config, label, _DTYPE_BYTES[dtype])
        fields = _llama_family(config, model_type, label, _DTYPE_BYTES[dtype])
        return {**fields, "vision": vision} if vision is not None else fields
    except KeyError as e:
        raise ModelSpecError(f"{model_type} config for {label} lacks {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"bad value in {model_type} config for {label}: {e}") from e


def _vision(config: dict[str, Any], model_type: str, name: str | None) -> VisionSpec | None:
    """The vision tower of `config` (policy/vision.py), or None; a bad field is named."""
    try:
        return vision_spec(config, model_type)
    except KeyError as e:
        label = name or model_type
        raise ModelSpecError(f"{model_type} vision_config for {label} lacks {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"bad value in {model_type} vision_config: {e}") from e


def _opt(config: dict[str, Any], label: str, dtype_bytes: int) -> dict[str, Any]:
    hidden, num_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return dict(
        name=label,
        arch="opt",
        model_type="opt",
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(config["ffn_dim"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=int(config["vocab_size"]),
        dtype_bytes=dtype_bytes,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        word_embed_dim=int(config.get("word_embed_proj_dim") or hidden),
        # OPT's learned position table has 2 extra rows (offset).
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)) + 2,
        qkv_bias=True,
    )


def _llama_family(
    config: dict[str, Any], model_type: str, label: str, dtype_bytes: int
) -> dict[str, Any]:
    if model_type == "nemotron_h" and "num_hidden_layers" not in config:
        # transformers 5 derives it from the layer kinds and does not write it
        kinds = config.get("layers_block_type") or config["hybrid_override_pattern"]
        config = {**config, "num_hidden_layers": len(kinds)}
    hidden, num_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    num_layers = int(config["num_hidden_layers"])
    qk_norm_params = 0
    per_head = model_type == "glm4_moe" and config.get("use_qk_norm")  # GLM's when configured
    if per_head or model_type in ("qwen3", "qwen3_moe", "gemma3_text", *_GATED_DELTA):
        qk_norm_params = 2 * head_dim
    elif model_type in ("olmo2", "olmo3", "olmoe"):  # norms over the whole q and k projections
        qk_norm_params = (num_heads + num_kv_heads) * head_dim
    hybrid = model_type in HYBRIDS
    window, num_local = (0, 0) if hybrid else _windows(config, model_type, num_layers)
    qkv_bias = bool(config.get("attention_bias", model_type == "gpt_oss"))  # the class default
    if model_type in ("qwen2", "qwen2_moe"):  # Qwen2's biases (qwen2_moe: unless qkv_bias says)
        qkv_bias = model_type == "qwen2" or bool(config.get("qkv_bias", True))
    mla = _mla(config, num_heads, hidden) if model_type == "deepseek_v3" else {}
    # Llama 4's dense layers are intermediate_size_mlp wide (its experts intermediate_size)
    dense_width_key = "intermediate_size"
    if model_type == "llama4_text":
        dense_width_key = "intermediate_size_mlp"
    elif model_type == "granitemoehybrid":  # its shared MLP; intermediate_size: its experts'
        dense_width_key = "shared_intermediate_size"
    fields = dict(
        name=label,
        arch="llama",
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(config[dense_width_key]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=int(config["vocab_size"]),
        dtype_bytes=dtype_bytes,
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", FAMILIES[model_type].tied_by_default)
        ),
        qkv_bias=qkv_bias,
        num_norms=4 if model_type in ("gemma2", "gemma3_text") else 2,
        qk_norm_params=qk_norm_params,
        sliding_window=window if num_local else 0,
        num_local_layers=num_local,
        **_experts(config, model_type, num_layers),
    )
    if model_type == "gpt_oss":
        fields.update(o_bias=qkv_bias, attention_sinks=True, moe_biases=True)
    if hybrid:
        fields.update(hybrid_fields(config, model_type, num_layers))
        fields["attention_output_gate"] = model_type in _GATED_DELTA
    if model_type == "falcon_h1":  # attention_bias on all four projections; mlp_bias
        fields.update(o_bias=qkv_bias, mlp_bias=bool(config.get("mlp_bias", False)))
    if model_type == "nemotron_h":  # one norm and one mixer or MLP per layer; no q/k/v biases
        fields.update(
            num_norms=1,
            qkv_bias=False,
            gated_mlp=False,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )
    return {**fields, **mla}


def _experts(config: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields, as each family's config class names them; {} for a dense family.
    The expert count may be spelled num_experts or num_local_experts (transformers 5 writes
    Qwen3-MoE's under the latter)."""
    if model_type in ("glm4_moe", "deepseek_v3"):
        return _grouped_experts(config, num_layers)
    if model_type == "llama4_text":
        return _llama4_experts(config, num_layers)
    if model_type == "granitemoehybrid":
        return _granite_experts(config, num_layers)
    if model_type == "nemotron_h":
        return _nemotron_experts(config, num_layers)
    if model_type == "gpt_oss":  # every layer; experts as wide as intermediate_size
        return dict(
            num_experts=int(config["num_local_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["intermediate_size"]),
            moe_layer_ids=tuple(range(num_layers)),
        )
    if model_type not in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", *_QWEN_SHARED):
        return {}
    key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    num_experts = int(config[key])
    if model_type in ("mixtral", "olmoe"):  # every layer; experts as wide as intermediate_size
        width = int(config["intermediate_size"])
        layers = list(range(num_layers))
    else:
        # transformers: layer i is sparse unless listed in mlp_only_layers, when
        # (i + 1) % decoder_sparse_step == 0 and num_experts > 0.
        width = int(config["moe_intermediate_size"])
        dense = {int(i) for i in config.get("mlp_only_layers") or ()}
        step = int(config.get("decoder_sparse_step", 1) or 1)
        layers = [
            i for i in range(num_layers) if i not in dense and num_experts and (i + 1) % step == 0
        ]
    if not num_experts or not layers:
        return {}  # an MoE family configured dense
    shared = 0
    if model_type in ("qwen2_moe", *_QWEN_SHARED):
        shared = int(config.get("shared_expert_intermediate_size") or 0)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=shared,
        moe_layer_ids=tuple(layers),
    )


def _granite_experts(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite 4 hybrid's: num_local_experts as wide as intermediate_size on every layer,
    beside its shared MLP (shared_intermediate_size, ungated); {} when it has none."""
    num_experts = int(config.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["intermediate_size"]),
        shared_expert_intermediate_size=int(config["shared_intermediate_size"]),
        shared_expert_gate=False,
        moe_layer_ids=tuple(range(num_layers)),
    )


def _nemotron_experts(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Nemotron 3's: its 'moe' layers, n_routed_experts of moe_intermediate_size (squared
    ReLU, up and down, over the moe_latent_size latent where set) beside one shared MLP of
    moe_shared_expert_intermediate_size, ungated; {} without MoE layers."""
    kinds = layer_kinds(config, "nemotron_h", num_layers)
    layers = tuple(i for i, kind in enumerate(kinds) if kind in MOE_KINDS)
    if not layers:
        return {}
    return dict(
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(config["moe_shared_expert_intermediate_size"]),
        shared_expert_gate=False,
        moe_latent_size=int(config.get("moe_latent_size") or 0),
        moe_layer_ids=layers,
    )


def _grouped_experts(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's: n_routed_experts, n_shared_experts as one SwiGLU that many
    times moe_intermediate_size wide (without Qwen2-MoE's gate), the first
    first_k_dense_replace layers dense."""
    width = int(config["moe_intermediate_size"])
    first_dense = int(config.get("first_k_dense_replace", 1))
    return dict(
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width * int(config.get("n_shared_experts", 1) or 0),
        shared_expert_gate=False,
        moe_layer_ids=tuple(range(min(first_dense, num_layers), num_layers)),
    )


def _llama4_experts(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Llama 4's: num_local_experts as wide as intermediate_size on `moe_layers` (else every
    interleave_moe_layer_step-th layer), and a shared expert as wide, ungated."""
    step = int(config.get("interleave_moe_layer_step", 1) or 1)
    layers = config.get("moe_layers") or range(step - 1, num_layers, step)
    width = int(config["intermediate_size"])
    return dict(
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config.get("num_experts_per_tok", 1)),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width,
        shared_expert_gate=False,
        moe_layer_ids=tuple(int(i) for i in layers),
    )


def _mla(config: dict[str, Any], num_heads: int, hidden: int) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: its parameters, and the KV row the engine
    keeps (one head of kv_lora_rank + qk_rope_head_dim, once: its value is its key)."""
    rank, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    nope, value = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    q_rank = int(config.get("q_lora_rank") or 0)
    q_width = num_heads * (nope + rope)
    q = hidden * q_rank + q_rank + q_rank * q_width if q_rank else hidden * q_width
    kv = hidden * (rank + rope) + rank + rank * num_heads * (nope + value)
    bias = (q_rank + rank + rope + hidden) if config.get("attention_bias") else 0
    return dict(
        num_kv_heads=1,
        head_dim=rank + rope,
        values_are_keys=True,
        qkv_bias=False,
        mla_attention_params=q + kv + num_heads * value * hidden + bias,
    )


def _windows(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, int]:
    """(sliding window, number of layers that have it), as each family's config class
    derives them: `layer_types` where given, else the family's own rule."""
    if model_type == "llama4_text":
        return _llama4_chunks(config, num_layers)
    default = 4096 if model_type in ("gemma2", "gemma3_text", "olmo3") else 0
    window = int(config.get("sliding_window", default) or 0)
    if not window:
        return 0, 0
    types = config.get("layer_types")
    if isinstance(types, list):
        return window, sum(1 for kind in types if kind == "sliding_attention")
    if model_type == "olmo3":  # every fourth layer is global
        return window, num_layers - num_layers // 4
    if model_type == "smollm3":  # windows, when on, on the NoPE layers
        if not config.get("use_sliding_window", False):
            return 0, 0
        flags = config.get("no_rope_layers")
        interval = int(config.get("no_rope_layer_interval", 4))
        nope = flags.count(0) if isinstance(flags, list) else num_layers // interval
        return window, nope
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not config.get("use_sliding_window", False):
            return 0, 0
        first = int(config.get("max_window_layers", 28))
        return window, max(0, num_layers - first)
    if model_type == "gemma2":  # layers 0, 2, 4, ... are local
        return window, (num_layers + 1) // 2
    if model_type == "gemma3_text":  # every sliding_window_pattern-th layer is global
        pattern = int(config.get("sliding_window_pattern", 6))
        return window, num_layers - num_layers // pattern
    return window, num_layers  # Mistral, Mixtral, Phi-3: every layer


def _llama4_chunks(config: dict[str, Any], num_layers: int) -> tuple[int, int]:
    """Llama 4's chunked attention priced as a sliding window of attention_chunk_size (a
    query reads at most that many keys: its own chunk's, C / 2 on average, so the price is an
    upper bound) on the rotary layers (`layer_types` where given, else those `no_rope_layers`
    marks 1, else all but every no_rope_layer_interval-th)."""
    chunk = int(config.get("attention_chunk_size", 8192) or 0)
    if not chunk:
        return 0, 0
    types = config.get("layer_types")
    if isinstance(types, list):
        return chunk, sum(1 for kind in types if kind == "chunked_attention")
    flags = config.get("no_rope_layers")
    if isinstance(flags, list) and flags:
        return chunk, sum(1 for rope in flags[:num_layers] if rope)
    interval = int(config.get("no_rope_layer_interval", 4))
    return chunk, num_layers - num_layers // interval
