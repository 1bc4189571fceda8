"""`SamplingParams`: how one request's tokens are chosen and when it stops (torch-free)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from base.errors import UserError
from engine.core.structured import StructuredOutput
from engine.core.structured import check as check_structured

MAX_LOGPROBS = 20
"""The most top alternatives a position returns (vLLM's cap; OpenAI's completions take 5)."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in [-100, 100] (OpenAI's range)."""


class SamplingError(UserError, ValueError):
    """Sampling parameters that cannot be honoured (out of range, wrong type)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, with vLLM's names and OpenAI's meanings.

    temperature == 0 is greedy decoding. `seed` makes sampling reproducible
    for this request regardless of what else shares the batch.
    """

    max_tokens: int = 16
    """0 only with echo (the prompt and its logprobs, nothing generated) or `pooling`."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k filtering."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (0: off)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings; the output is cut before the first one and it is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    """Neither EOS, `stop_token_ids` nor a stop string ends the output before this many
    tokens (vLLM's)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output so far, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """A token seen in the prompt or the output has its logit divided by this (multiplied
    when negative), > 0; 1 is off (vLLM's and transformers')."""
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    """Token id -> a value in [-100, 100] added to its logit before sampling."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled."""
    bad_words: tuple[str, ...] = ()
    """Words that are never generated (vLLM's): each is tokenized with and without a
    leading space (`bad_words_token_ids`), and the last token of a tokenization is banned
    wherever the output ends with the rest of it."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """`bad_words` as token ids; set by whoever holds the tokenizer (`with_tokenizer`)."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar
    (engine/core/structured.py)."""
    logprobs: int | None = None
    """Return this many top alternatives (plus the chosen token) per generated token."""
    n: int = 1
    echo: bool = False
    skip_special_tokens: bool = True
    """The output's text leaves the tokenizer's special tokens out (vLLM's default); False
    keeps them (gpt-oss's harmony channels are read from them, server/openai/parsers/harmony.py)."""
    pooling: bool = False
    """A pooling request (an embedder's or a decoder reranker's, engine/core/pooling.py): the
    prompt runs as a prefill only and the answer is its last position's pooled output
    (`SequenceDelta.pooled`), not tokens; needs max_tokens 0."""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "bad_words"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids)
        )
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.max_tokens == 0 and not (self.echo or self.pooling):
            raise SamplingError("max_tokens may be 0 only with echo (the prompt's logprobs)")
        if self.pooling and (self.max_tokens or self.echo):
            raise SamplingError("a pooling request generates nothing: max_tokens 0, no echo")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise SamplingError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise SamplingError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise SamplingError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}"
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise SamplingError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")
        if any(not w for w in self.bad_words):
            raise SamplingError("bad_words must be non-empty strings")

    def with_tokenizer(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These settings with `bad_words` tokenized by `encode` (no special tokens): each
        word as it is and after a space, as vLLM tokenizes them."""
        if not self.bad_words or self.bad_words_token_ids:
            return self
        ids: dict[tuple[int, ...], None] = {}
        for word in self.bad_words:
            for text in (word, " " + word.lstrip()):
                tokens = tuple(encode(text))
                if tokens:
                    ids[tokens] = None
        return dataclasses.replace(self, bad_words_token_ids=tuple(ids))

    def prepared(
        self, encode: Callable[[str], list[int]] | None, vocab_size: int
    ) -> SamplingParams:
        """These settings ready for the engine: bad words tokenized (`encode`, no special
        tokens; needed when there are bad words), every named token id checked against the
        vocabulary, a structured output's grammar built and checked (within its time limit:
        engine/core/structured.py). Raises SamplingError or StructuredOutputError."""
        if self.bad_words and encode is None:
            raise SamplingError("bad_words need the model's tokenizer")
        params = self.with_tokenizer(encode) if encode is not None else self
        params.check_vocab(vocab_size)
        if params.structured is not None:
            check_structured(params.structured)
        return params

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id these settings name lies in the vocabulary (else SamplingError)."""
        named = {
            "logit_bias": list(self.logit_bias),
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "stop_token_ids": list(self.stop_token_ids),
        }
        for name, ids in named.items():
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingError(
                    f"{name} names token {bad[0]}, outside the vocabulary of {vocab_size}"
                )

    @property
    def needs_history(self) -> bool:
        """The logits stage reads the sequence's tokens: penalties, min_tokens, bad words
        and structured outputs (to replay them after a recompute)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.bad_words_token_ids
            or self.structured is not None
        )

    @property
    def processes_logits(self) -> bool:
        """Anything in the logits stage (engine/executor/logits.py) applies to this row."""
        return bool(self.needs_history or self.logit_bias or self.allowed_token_ids is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scores_prompt(self) -> bool:
        """echo + logprobs: the prompt's positions get logprobs too."""
        return self.echo and self.logprobs is not None
