"""What the engine hands back, and what its callers make of it (torch-free).

The engine runs every request with n == 1 and after each step hands a `SequenceDelta` per
request that changed: the new token ids, the new text and logprobs, and the finish reason
once it ends. In front, one `ChoiceAccumulator` per choice adds them up (the daemon's
serving layer and `LLM` alike); `RequestOutput` and `CompletionOutput` are `LLM`'s public
records (vLLM's shape), built once a request is finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.protocol import TokenLogprobs


@dataclass(slots=True)
class SequenceDelta:
    """What one engine request (one choice) gained in one step. `Sequence.delta` builds one
    a token with positional arguments, in this order (keywords take half as long again)."""

    request_id: str
    """The engine request's id (a child's, `ParentRequest`, when the caller asked for n > 1)."""
    new_token_ids: list[int]
    """Tokens sampled in this step (at most one; none when only the finish is news; all of a
    choice's in the one delta of a request that does not stream). A stop token (EOS or a
    stop_token_id) is included, its text is not."""
    new_text: str
    """Text these tokens completed ("" without a detokenizer, or while a character or a
    possible stop string is incomplete); joined, the pieces are the choice's text."""
    new_logprobs: list[TokenLogprobs] | None = None
    """One entry per new token when sampling asked for logprobs, else None."""
    finish_reason: str | None = None
    """'stop' (EOS, stop token, stop string), 'length' (max_tokens, context), 'abort' or
    'error' on the choice's last delta; None before."""
    stop_reason: int | str | None = None
    """The stop_token_id or stop string that ended the choice (None for EOS and length)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """echo + logprobs: the prompt's logprobs, on the delta of the first token only."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (at the first admission)."""
    index: int = 0
    """The choice's index among its parent request's n (set in front by `ParentRequest`)."""
    error: str | None = None
    """With finish_reason 'error': what failed inside a step (its sampling: a token id outside
    the vocabulary, a grammar error; or the engine's offload storage)."""
    first_token_time: float | None = None
    """A delta that sums a whole choice (a request that does not stream): when its first
    token reached the front (`time.monotonic()`), for time-to-first-token figures."""
    retryable: bool = False
    """With finish_reason 'error': the failure was the engine's storage, not the request's
    (a full offload disk): the same request may succeed later."""
    pooled: list[float] | None = None
    """A pooling request's answer, on its last delta: the vector (an embedder's, pooled and
    normalized as it declares) or the one score (a decoder reranker's)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a finished request."""

    index: int
    """Choice index in [0, n)."""
    text: str
    """Detokenized output, cut before the first stop string ("" without a detokenizer)."""
    token_ids: list[int]
    """Generated token ids; the stop token (EOS or a stop_token_id) is the last one if any."""
    finish_reason: str | None
    """'stop' (EOS, stop token, stop string), 'length' (max_tokens, context), 'abort',
    'error' (its sampling failed inside a step: `error` says how) or None."""
    logprobs: list[TokenLogprobs] | None = None
    """One entry per generated token when sampling.logprobs is set, else None."""
    stop_reason: int | str | None = None
    """The stop_token_id or stop string that ended the choice (None for EOS and length)."""
    error: str | None = None
    """With finish_reason 'error': what failed."""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request with every choice: its prompt and its outputs."""

    request_id: str
    """The caller's id."""
    prompt_token_ids: list[int]
    """The prompt as submitted."""
    outputs: list[CompletionOutput]
    """One entry per choice, ordered by index."""
    finished: bool
    """True once every choice has finished."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Logprobs of the prompt tokens when sampling asked for echo with logprobs."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed (vLLM's
    field; with n > 1, the first choice's)."""


@dataclass(slots=True)
class ChoiceAccumulator:
    """One choice as its deltas add up: O(1) per delta, the text joined once when read."""

    index: int
    """Choice index in [0, n) of its request (the daemon numbers across prompts)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    """One entry per token when the request asked for logprobs, else None."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    num_chars: int = 0
    """Characters of text so far (where the next piece starts)."""
    error: str | None = None
    first_token_time: float | None = None
    """When its first token was added (`time.monotonic()`)."""
    _pieces: list[str] = field(default_factory=list)

    def add(self, delta: SequenceDelta) -> None:
        if self.first_token_time is None:
            self.first_token_time = delta.first_token_time
            if self.first_token_time is None and delta.new_token_ids:
                self.first_token_time = time.monotonic()
        self.token_ids += delta.new_token_ids
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.new_logprobs
        if delta.new_text:
            self._pieces.append(delta.new_text)
            self.num_chars += len(delta.new_text)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error = delta.error

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, wants_logprobs: bool) -> CompletionOutput:
        """`LLM`'s record of this choice; `wants_logprobs`: logprobs as a list even if empty."""
        logprobs = (self.logprobs or []) if wants_logprobs else None
        return CompletionOutput(
            self.index,
            self.text,
            self.token_ids,
            self.finish_reason,
            logprobs,
            self.stop_reason,
            self.error,
        )
