"""`ModelFacts`: what the daemon reads from a model's directory to serve it, torch-free.

Read once at start, beside the tokenizer: the context length, the longest token's bytes
(a prompt's size bound), the sampling defaults, and whether the model pools or sees images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.core.engine_args import EngineArgs
from engine.core.media import VisionSpec
from engine.core.model_files import generation_defaults
from engine.core.pooling import PoolingSpec, pooling_spec


@dataclass(frozen=True)
class ModelFacts:
    """A served model's limits and defaults; the empty record before it is read."""

    max_model_len: int = 0
    """Context window in tokens (EngineArgs.context_len)."""
    max_token_bytes: int = 0
    """The longest vocabulary entry in UTF-8 bytes (`longest_token_bytes`)."""
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    """The model's sampling defaults (generation_config.json) by SamplingParams field."""
    pooling: PoolingSpec | None = None
    """A decoder pooling model's spec (engine/core/pooling.py); None: it generates."""
    vision: VisionSpec | None = None
    """How the model takes images; None: text alone."""

    @classmethod
    def read(cls, model_dir: Path, args: EngineArgs) -> ModelFacts:
        return cls(
            max_model_len=args.context_len(model_dir),
            max_token_bytes=longest_token_bytes(model_dir),
            generation_defaults=generation_defaults(model_dir),
            pooling=pooling_spec(model_dir),
            vision=VisionSpec.from_model_dir(model_dir),
        )


def longest_token_bytes(model_dir: Path) -> int:
    """The longest vocabulary entry (added tokens included) in UTF-8 bytes, as spelled in
    tokenizer.json. A spelling is never shorter than the text it decodes to (byte-level
    BPE spells a byte as one character, SentencePiece a space as '▁', a fallback byte as
    '<0x41>'), so this bounds the bytes of text per token from above."""
    vocab = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(True)
    return max((len(piece.encode()) for piece in vocab), default=1)
