"""`RequestOutput` and `CompletionOutput`: what the engine hands back per request (vLLM's shape).

Outputs are cumulative: every yield for a request carries all text, token ids
and logprobs generated so far, with stop strings already cut off.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.protocol import TokenLogprobs
from engine.core.sequence import Sequence


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request (one `Sequence`)."""

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
    """The state of one request after a step: its prompt and every choice so far."""

    request_id: str
    """The caller's id, as given to `add_request`."""
    prompt_token_ids: list[int]
    """The prompt as submitted."""
    outputs: list[CompletionOutput]
    """One entry per choice, ordered by index."""
    finished: bool
    """True once every choice has finished; this is the request's last output."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Logprobs of the prompt tokens when sampling asked for echo with logprobs."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed (vLLM's
    field; with n > 1, the first choice's)."""


def request_output(seqs: list[Sequence]) -> RequestOutput:
    """Snapshot of one request's choices (copies: later steps do not change it)."""
    outputs = [
        CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=s.output_token_ids,
            finish_reason=s.finish_reason,
            logprobs=list(s.logprobs) if s.sampling.logprobs is not None else None,
            stop_reason=s.stop_reason,
            error=s.error,
        )
        for s in seqs
    ]
    request = seqs[0].request
    finished = all(s.is_finished for s in seqs)
    prompt_logprobs = seqs[0].prompt_logprobs
    return RequestOutput(
        request.request_id,
        list(request.prompt_token_ids),
        outputs,
        finished,
        prompt_logprobs,
        seqs[0].num_cached_tokens or 0,
    )
