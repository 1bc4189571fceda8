"""`SamplingParams`: how one request's tokens are chosen and when it stops (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from policy.errors import UserError

MAX_LOGPROBS = 20
"""The most top alternatives a position returns (vLLM's cap; OpenAI's completions take 5)."""


class SamplingError(UserError, ValueError):
    """Sampling parameters that cannot be honoured (out of range, wrong type)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, with vLLM's names and OpenAI's meanings.

    temperature == 0 is greedy decoding. `seed` makes sampling reproducible
    for this request regardless of what else shares the batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k filtering."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings; the output is cut before the first one and it is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return this many top alternatives (plus the chosen token) per generated token."""
    n: int = 1
    echo: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def scores_prompt(self) -> bool:
        """echo + logprobs: the prompt's positions get logprobs too."""
        return self.echo and self.logprobs is not None
