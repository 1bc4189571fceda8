"""`Request` (what a caller asked for) and `Sequence` (one choice being generated), torch-free.

The engine runs one choice per request (`ParentRequest` fans out n in front), so a
request is one sequence. A sequence's tokens are the prompt followed by what it
generated; `num_computed_tokens` of them are in its KV cache (or scheduled to be), so the
next chunk always starts there. A preempted sequence drops its KV and is recomputed from
token 0 later.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.core.detokenizer import Detokenizer, IncrementalDetokenizer
from engine.core.media import SeqMedia, cache_token_ids
from engine.core.outputs import SequenceDelta
from engine.core.protocol import TokenLogprobs
from engine.core.sampling_params import SamplingParams

ONLINE_PRIORITY = 0
"""Online calls (completions, chat): admitted before any batch work."""
BATCH_PRIORITY = 1
"""Batch API work: admitted when no online request waits."""


@dataclass(slots=True)
class Request:
    """One generation request as the scheduler receives it."""

    request_id: str
    """Caller-chosen id, unique among unfinished requests."""
    prompt_token_ids: list[int]
    """The tokenized prompt (non-empty)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How tokens are chosen and when the request stops; the engine takes n == 1 only."""
    priority: int = ONLINE_PRIORITY
    """Lower runs first: ONLINE_PRIORITY (0) before BATCH_PRIORITY (1); FIFO within one."""
    arrival_time: float = field(default_factory=time.monotonic)
    """When the request arrived (monotonic seconds), for latency figures."""
    group: str | None = None
    """The caller's request this is one choice of (`ParentRequest`'s n > 1 children share
    it): the first of them to compute the prompt forks its KV to the others, which then skip
    the prompt (`Scheduler`, with prefix caching)."""
    media: SeqMedia | None = None
    """The prompt's images (engine/core/media.py); None: text alone."""
    final_only: bool = False
    """Its caller reads only the finished choice (an answer that does not stream, `LLM`'s
    outputs; vLLM's RequestOutputKind.FINAL_ONLY): the engine hands out no delta until the
    choice ends, then one with all of it, and without stop strings decodes its text once."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's state of one request: its tokens, its place in the batch, its stop state."""

    seq_id: int
    request: Request
    token_ids: list[int]
    """Prompt followed by the generated tokens known so far."""
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer | None = None
    """Its output as text, piece by piece, and its stop strings (None: no text)."""
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is computed or scheduled; the next chunk starts here."""
    num_pending: int = 0
    """Samples scheduled whose token has not come back yet (asynchronous scheduling)."""
    prompt_logprobs: list[TokenLogprobs] | None = None
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
    retryable: bool = False
    """It failed for the engine's storage, not for itself: the same request may succeed later."""
    state_restore: tuple[str, int] | None = None
    """A hybrid's admission that hit the prefix cache: the snapshot of the state at the end
    of its cached prefix, sent with its first chunk."""
    state_save: tuple[int, str] | None = None
    """A hybrid's sequence whose cached KV prefix runs past its last saved state: (tokens,
    hash of the prefix's last page) where its state is to be saved (`StateSnapshots`)."""
    num_offload_faults: int = 0
    """Steps of it that failed on the offload storage (each time it was recomputed)."""
    decodes_at_end: bool = False
    """Final-only and no stop strings: nothing needs the text before the end, so it is
    decoded once then (by the same detokenizer, so the same text)."""
    first_token_time: float | None = None
    """When its first token was sampled (final-only requests: the delta carries it)."""
    _pieces: list[str] = field(default_factory=list)
    """Final-only: the text handed out so far (with stop strings, decoded per token)."""
    _logprobs: list[TokenLogprobs] | None = None
    """Final-only: the logprobs of the tokens so far, when its sampling asks for them."""

    @classmethod
    def from_request(
        cls, request: Request, seq_id: int, detokenizer: Detokenizer | None
    ) -> Sequence:
        prompt = list(request.prompt_token_ids)
        text = None
        if detokenizer is not None:
            sampling = request.sampling
            text = IncrementalDetokenizer(detokenizer, sampling.stop, sampling.skip_special_tokens)
        seq = cls(seq_id, request, prompt, len(prompt), text)
        seq.decodes_at_end = request.final_only and not request.sampling.stop
        return seq

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def cache_token_ids(self) -> list[int]:
        """Its tokens as the prefix cache keys them (`media.cache_token_ids`: an image's
        tokens stand for the image)."""
        return cache_token_ids(self.token_ids, self.request.media)

    def whole_images(self, start: int, num_new: int) -> int:
        """A prefill chunk of `num_new` tokens from `start` cut before an image whose tokens
        attend both ways, where it would end inside it (`SeqMedia.whole_images`)."""
        media = self.request.media
        return num_new if media is None else media.whole_images(start, num_new)

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

    def fail(self, message: str, retryable: bool = False) -> None:
        """Finish with finish_reason 'error': its sampling failed inside a step, or (retryable)
        the engine's storage failed it."""
        self.error, self.retryable = message, retryable
        self.finish("error")

    def append_token(
        self,
        token_id: int,
        logprobs: TokenLogprobs | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> SequenceDelta | None:
        """Record one sampled token, finish the sequence if a stop condition holds, and say
        what is new (`report`: None for a final-only request that goes on).

        Order: EOS (unless ignore_eos), stop_token_ids, stop strings, max_tokens,
        context length. A stop token stays in token_ids but not in the text; a stop
        string ends the text before it.
        """
        sampling = self.request.sampling
        if sampling.max_tokens == 0:  # echo only: the prompt's logprobs, no output
            self.finish("length")
            return self.report([], "", None)
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        new_logprobs = [logprobs] if sampling.logprobs is not None and logprobs else None
        num_generated = len(self.token_ids) - self.num_prompt_tokens
        ends = num_generated >= sampling.max_tokens or len(self.token_ids) >= max_model_len
        detokenizer = None if self.decodes_at_end else self.detokenizer
        text = ""
        if num_generated < sampling.min_tokens:  # only length ends it before then
            if detokenizer is not None:
                text = detokenizer.add([token_id], final=ends, find_stop=False)
            if ends:
                self.finish("length")
            return self.report([token_id], text, new_logprobs)
        is_eos = token_id in eos_token_ids and not sampling.ignore_eos
        if is_eos or token_id in sampling.stop_token_ids:
            if detokenizer is not None:  # the stop token's own text is not output
                text = detokenizer.flush()
            self.finish("stop", None if is_eos else token_id)
        else:
            if detokenizer is not None:
                if ends:
                    text = detokenizer.add([token_id], True)
                else:
                    text = detokenizer.add_token(token_id)
                if detokenizer.stop_hit is not None:
                    self.finish("stop", detokenizer.stop_hit)
            if ends and not self.is_finished:
                self.finish("length")
        return self.report([token_id], text, new_logprobs)

    def report(
        self, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None
    ) -> SequenceDelta | None:
        """What this step hands out: its delta; for a final-only request nothing until the
        choice ends, then all of it as one delta (tokens, text, logprobs, prompt logprobs,
        first token time)."""
        if not self.request.final_only:
            return self.delta(token_ids, text, logprobs)
        if text:
            self._pieces.append(text)
        if logprobs:  # appended in place: a copy per token would cost O(n^2) over a choice
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        if not self.is_finished:
            return None
        output = self.output_token_ids
        if self.decodes_at_end and self.detokenizer is not None:
            stopped = self.finish_reason == "stop"  # by EOS or a stop token: not in the text
            self._pieces.append(self.detokenizer.add(output[:-1] if stopped else output, True))
        delta = self.delta(output, "".join(self._pieces), self._logprobs)
        delta.prompt_logprobs = self.prompt_logprobs
        delta.first_token_time = self.first_token_time
        return delta

    def pool(self, output: list[float]) -> SequenceDelta:
        """A pooling request's prompt has run: finish it ('stop') with its pooled output."""
        self.finish("stop")
        self.first_token_time = time.monotonic()
        delta = self.delta([], "", None)
        delta.pooled, delta.first_token_time = output, self.first_token_time
        return delta

    def abort(self) -> SequenceDelta:
        """End it unfinished ('abort'); its last delta (the text held back, no token)."""
        text = self.detokenizer.flush() if self.detokenizer is not None else ""
        self.finish("abort")
        return self.delta([], text, None)

    def delta(
        self, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None
    ) -> SequenceDelta:
        return SequenceDelta(  # positional (a delta a token): keywords cost a third more
            self.request.request_id,
            token_ids,
            text,
            logprobs,
            self.finish_reason,
            self.stop_reason,
            None,
            self.num_cached_tokens or 0,
            0,
            self.error,
            None,
            self.retryable,
        )
