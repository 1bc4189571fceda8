"""`Request` (what a caller asked for) and `Sequence` (one choice being generated), torch-free.

A request with n choices expands to n sequences. A sequence's tokens are the
prompt followed by what it generated; `num_computed_tokens` of them are in its
KV cache (or scheduled to be), so the next chunk always starts there. A
preempted sequence drops its KV and is recomputed from token 0 later.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.protocol import TokenLogprobs
from engine.core.sampling_params import SamplingParams

ONLINE_PRIORITY = 0
"""Online calls (completions, chat): admitted before any batch work."""
BATCH_PRIORITY = 1
"""Batch API work: admitted when no online request waits."""


class Detokenizer(Protocol):
    """Turns generated token ids into text (the daemon's tokenizer, skipping special tokens)."""

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler receives it."""

    request_id: str
    """Caller-chosen id, unique among unfinished requests."""
    prompt_token_ids: list[int]
    """The tokenized prompt (non-empty)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How tokens are chosen and when each choice stops; `n` choices are generated."""
    priority: int = ONLINE_PRIORITY
    """Lower runs first: ONLINE_PRIORITY (0) before BATCH_PRIORITY (1); FIFO within one."""
    arrival_time: float = field(default_factory=time.monotonic)
    """When the request arrived (monotonic seconds), for latency figures."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of a request: its tokens, its place in the batch and its stop state."""

    seq_id: int
    request: Request
    index: int
    """Choice index in [0, n)."""
    sampling: SamplingParams
    """The request's sampling with n=1 and, when seeded, seed + index."""
    token_ids: list[int]
    """Prompt followed by the generated tokens known so far."""
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is computed or scheduled; the next chunk starts here."""
    num_pending: int = 0
    """Samples scheduled whose token has not come back yet (asynchronous scheduling)."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    _prefix_at: int = field(init=False)
    """Incremental detokenizing: the token (in token_ids) from which the text of the tokens
    after `_read_at` is decoded, so that a tokenizer that reads a token by its neighbours
    (a leading space, a byte of a multi-byte character) sees the same ones."""
    _read_at: int = field(init=False)
    """The token (in token_ids) up to which `text` is decoded."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    slot: int = -1
    """Position in the block while running; gpu_batch = slot // gpu_batch_size."""
    kv_tier: str = ""
    act_tier: str = ""
    is_sent: bool = False
    """The engine holds state for this sequence (sampling was sent with a chunk)."""
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache at its first admission."""
    epoch: int = 0
    """Times it was preempted (its KV dropped); plans made before that are stale for it."""
    error: str | None = None
    """Why it failed (finish_reason 'error'), else None."""

    def __post_init__(self) -> None:
        self._prefix_at = self._read_at = self.num_prompt_tokens

    @classmethod
    def expand(cls, request: Request, first_seq_id: int) -> list[Sequence]:
        """One sequence per choice; choice i samples with seed + i when a seed is set."""
        base = request.sampling
        seqs = []
        for i in range(base.n):
            seed = None if base.seed is None else base.seed + i
            sampling = dataclasses.replace(base, n=1, seed=seed)
            prompt = list(request.prompt_token_ids)
            seqs.append(cls(first_seq_id + i, request, i, sampling, prompt, len(prompt)))
        return seqs

    @property
    def wants_prompt_logprobs(self) -> bool:
        """echo + logprobs, and its prompt's logprobs not computed yet (a recompute after
        preemption keeps the first ones)."""
        return self.sampling.scores_prompt and self.prompt_logprobs is None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens including the samples still in flight."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_remaining(self) -> int:
        """Tokens this sequence may still generate beyond the ones known or in flight."""
        return self.sampling.max_tokens - self.num_generated - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def will_finish(self, max_model_len: int) -> bool:
        """A sample in flight will end it (max_tokens or context): plan nothing more for it."""
        return self.num_pending > 0 and (
            self.num_remaining <= 0 or self.num_tokens >= max_model_len
        )

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def fail(self, message: str) -> None:
        """Finish with finish_reason 'error': its sampling failed inside a step."""
        self.error = message
        self.finish("error")

    def append_token(
        self,
        token_id: int,
        logprobs: TokenLogprobs | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        detokenizer: Detokenizer | None,
    ) -> None:
        """Record one sampled token, then finish the sequence if a stop condition holds.

        Order: EOS (unless ignore_eos), stop_token_ids, stop strings, max_tokens,
        context length. A stop token stays in token_ids but not in text; a stop
        string is cut from text together with everything after it.
        """
        if self.sampling.max_tokens == 0:  # echo only: the prompt's logprobs, no output
            self.finish("length")
            return
        self.token_ids.append(token_id)
        if self.sampling.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        ends = (
            self.num_generated >= self.sampling.max_tokens or len(self.token_ids) >= max_model_len
        )
        if self.num_generated < self.sampling.min_tokens:  # only length ends it before then
            if detokenizer is not None:
                self._detokenize(detokenizer, len(self.token_ids), final=ends)
            if ends:
                self.finish("length")
            return
        is_eos = token_id in eos_token_ids and not self.sampling.ignore_eos
        if is_eos or token_id in self.sampling.stop_token_ids:
            if detokenizer is not None:  # the stop token's own text is not output
                self._detokenize(detokenizer, len(self.token_ids) - 1, final=True)
            self.finish("stop", None if is_eos else token_id)
            return
        if detokenizer is not None:
            searched_to = len(self.text)
            self._detokenize(detokenizer, len(self.token_ids), final=ends)
            if self._cut_at_stop_string(searched_to):
                return
        if ends:
            self.finish("length")

    def _detokenize(self, detokenizer: Detokenizer, upto: int, final: bool) -> None:
        """Append the text of token_ids[_read_at:upto] (vLLM's and TGI's incremental
        detokenizer: decode from `_prefix_at` with and without the new tokens and keep the
        difference), O(new tokens) per call instead of decoding the whole output. Text that
        ends inside a multi-byte character waits for the next token unless `final`."""
        if upto <= self._read_at:
            return
        seen = detokenizer.decode(self.token_ids[self._prefix_at : self._read_at])
        text = detokenizer.decode(self.token_ids[self._prefix_at : upto])
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return  # nothing whole yet
        self.text += text[len(seen) :]
        self._prefix_at, self._read_at = self._read_at, upto

    def _cut_at_stop_string(self, searched_to: int) -> bool:
        """Cut the text at the first stop string; `text[:searched_to]` held none (a stop
        string may still end in the new text and start before it)."""
        if not self.sampling.stop:
            return False
        start = max(0, searched_to - max(map(len, self.sampling.stop)) + 1)
        hits = [(self.text.find(s, start), s) for s in self.sampling.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.text = self.text[:pos]
        self.finish("stop", stop)
        return True
