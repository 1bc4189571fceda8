"""What a pooling model declares (torch-free): whether a checkpoint embeds or scores, the
pooling its sentence-transformers files ask, and how long its inputs may be.

- A checkpoint with sentence-transformers' `modules.json` naming a `Pooling` module embeds,
  pooled as `1_Pooling/config.json` says (CLS, mean of the real tokens, last token), then
  normalized when a `Normalize` module follows. A decoder (Qwen3-Embedding) is one too.
- `BertModel`, `RobertaModel`, `XLMRobertaModel` without those files embed with CLS
  pooling, normalized (vLLM's default for them).
- `*ForSequenceClassification` of those families scores (a cross-encoder: one logit a pair).
- A decoder reranker scores (Qwen3-Reranker, a `*ForCausalLM`: the last token's logit of "yes"
  against "no", through a sigmoid): its config says so as vLLM's overrides do
  (`is_original_qwen3_reranker` or `classifier_from_token`), or its directory's name (or
  the hub cache's `models--Qwen--Qwen3-Reranker-*` above it) says `Qwen3-Reranker`. A
  decoder `*ForSequenceClassification` (a converted reranker) scores with its own one-logit
  `score` head.
- Anything else generates (None).

Decoder pooling models run through the generation engine (planner, tiers, offloading:
engine/executor/pooler.py); encoders on their own runner (engine/pooling_runner.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.model_files import ModelLoadError

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
"""model_type values run by engine/models/bert.py; other pooling models are decoders."""
POOLINGS = ("cls", "mean", "last")


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How one pooling model turns tokens into its answer."""

    task: str
    """'embed' (a vector per input) or 'score' (a relevance logit per (query, document))."""
    pooling: str
    """'cls' (the first token), 'mean' (over the real tokens) or 'last' (the last token)."""
    normalize: bool
    """Vectors are scaled to unit L2 norm."""
    is_encoder: bool
    """BERT-style (bidirectional, engine/models/bert.py); else a decoder."""
    dimensions: int
    """The vector's length (the hidden size)."""
    max_length: int
    """The most tokens of one input."""
    vocab_size: int
    """Token ids the model embeds (its config's, which a tokenizer may not fill)."""
    matryoshka: tuple[int, ...] | bool = False
    """Shorter vectors the model was trained for (`dimensions` in a request): the sizes it
    lists, True when any size, False when none."""
    classifier_token_ids: tuple[int, ...] = ()
    """A decoder reranker's (no, yes) token ids: the LM head's rows W[yes] - W[no] become its
    one-logit classifier (P(yes) of a softmax over the two = sigmoid of the difference);
    empty: the checkpoint's own `score` head, or not a decoder reranker."""

    def __post_init__(self) -> None:
        assert self.task in ("embed", "score") and self.pooling in POOLINGS

    def check_dimensions(self, asked: int) -> str | None:
        """Why a request's `dimensions` cannot be served (None: it can)."""
        if not self.matryoshka:
            return f"this model does not support matryoshka shortening (dimensions={asked})"
        if asked < 1 or asked > self.dimensions:
            return f"dimensions must be between 1 and {self.dimensions}, got {asked}"
        if isinstance(self.matryoshka, tuple) and asked not in self.matryoshka:
            sizes = ", ".join(str(d) for d in self.matryoshka)
            return f"dimensions must be one of {sizes} for this model, got {asked}"
        return None


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def pooling_spec(model_dir: Path) -> PoolingSpec | None:
    """The pooling `model_dir` declares, None for a generation model."""
    config = _read(model_dir / "config.json") or {}
    architectures = config.get("architectures") or []
    model_type = config.get("model_type", "")
    is_encoder = model_type in ENCODER_TYPES
    modules = _read(model_dir / "modules.json") or []
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    limit = (_read(model_dir / "sentence_bert_config.json") or {}).get("max_seq_length")
    positions = config.get("max_position_embeddings", 512)
    if is_encoder and model_type != "bert":
        positions -= config.get("pad_token_id", 1) + 1  # RoBERTa's positions skip padding
    common: dict[str, Any] = {
        "is_encoder": is_encoder,
        "dimensions": config.get("hidden_size", 0),
        "max_length": min(limit or positions, positions),
        "vocab_size": config.get("vocab_size", 0),
        "matryoshka": _matryoshka(config),
    }
    if "Pooling" in kinds:
        path = modules[kinds.index("Pooling")].get("path", "1_Pooling")
        pooled = _read(model_dir / path / "config.json") or {}
        return PoolingSpec("embed", _pooling(pooled), "Normalize" in kinds, **common)
    if not is_encoder:
        return _decoder_reranker(model_dir, config, common)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return PoolingSpec("score", "cls", False, **common)
    if any(a.endswith("Model") for a in architectures):
        return PoolingSpec("embed", "cls", True, **common)
    return None


RERANKER_TOKENS = ("no", "yes")
"""Qwen3-Reranker's answer tokens (its model card's), in the classifier's order."""


def _decoder_reranker(
    model_dir: Path, config: dict[str, Any], common: dict[str, Any]
) -> PoolingSpec | None:
    """A decoder that scores (see the module's docstring), else None (it generates)."""
    architectures = config.get("architectures") or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    declared = config.get("is_original_qwen3_reranker") or config.get("classifier_from_token")
    names = [model_dir.name, *(p for p in model_dir.resolve().parts if p.startswith("models--"))]
    named = any("qwen3-reranker" in name.lower() for name in names)  # its own, or its hub id's
    if not (declared or named or is_classifier):
        return None
    token_ids: tuple[int, ...] = ()
    if declared or named:
        words = tuple(config.get("classifier_from_token") or RERANKER_TOKENS)
        token_ids = _token_ids(model_dir, words)
    elif len(config.get("id2label") or {}) != 1:
        raise ModelLoadError(
            f"{model_dir}: a decoder classifier is served with one label (a relevance logit); "
            f"this one has {len(config.get('id2label') or {}) or 'no'} labels"
        )
    return PoolingSpec("score", "last", False, **common, classifier_token_ids=token_ids)


def _token_ids(model_dir: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of `tokens` (tokenizer.json's), each one token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tokenizer.token_to_id(token) for token in tokens]
    missing = [t for t, i in zip(tokens, ids, strict=True) if i is None]
    if missing:
        raise ModelLoadError(f"{model_dir}: the reranker's tokens {missing} are not in its vocab")
    return tuple(i for i in ids if i is not None)


def _pooling(config: dict[str, Any]) -> str:
    if config.get("pooling_mode_lasttoken"):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls"


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | bool:
    sizes = config.get("matryoshka_dimensions")
    if sizes:
        return tuple(int(d) for d in sizes)
    return bool(config.get("is_matryoshka"))
