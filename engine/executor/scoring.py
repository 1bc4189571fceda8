"""Scoring prompts: logits at every position (`PromptScorer`), a prompt's logprobs for echo
(`score_prompt`), a pooling request's answer from its head row (`pool`)."""

from __future__ import annotations

from typing import Protocol

import torch

from base.pages import PAGE_TOKENS
from engine.core.kv_pages import PageManager
from engine.core.protocol import SeqChunk
from engine.core.sampling_params import SamplingParams
from engine.executor.assembly import EngineAssembly
from engine.executor.gpu_batch import GpuBatch, SeqState
from engine.executor.pooler import Pooler
from engine.executor.sampler import top_logprobs


class Admits(Protocol):
    """What scoring uses of the step runner (`StepRunner`): its engine and sequences, the
    admission of a chunk and the GPU batch of one admitted chunk."""

    engine: EngineAssembly
    seqs: dict[int, SeqState]

    def admit(self, chunk: SeqChunk) -> None: ...

    def batch_of(self, chunk: SeqChunk) -> GpuBatch: ...


class PromptScorer:
    """Scores whole prompts through the step runner's engine, outside the scheduler's steps."""

    def __init__(self, steps: Admits) -> None:
        self.steps = steps

    def score(self, prompts: list[list[int]], prefill_len: int | None = None) -> list[torch.Tensor]:
        """(len, vocab) float32 logits at every position of each prompt: for offline
        log-likelihood evaluation and for measuring compressed paths. The first `prefill_len`
        tokens (all by default) run as one prefill; the rest one per step, as decodes that read
        the KV cache back. Uses its own KV pages: not while scheduled requests are in flight."""
        steps, e = self.steps, self.steps.engine
        pages = PageManager(PAGE_TOKENS, {})
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        out = []
        for i, prompt in enumerate(prompts):
            seq_id = -1 - i  # negative ids never collide with the scheduler's
            first = len(prompt) if prefill_len is None else max(1, min(prefill_len, len(prompt)))
            pieces = [(0, first)] + [(t, t + 1) for t in range(first, len(prompt))]
            logits = []
            for start, stop in pieces:
                new_pages = pages.append(seq_id, stop - start, "gpu")
                chunk = SeqChunk(
                    seq_id,
                    list(prompt[start:stop]),
                    start,
                    0,
                    new_pages,
                    "gpu",
                    "gpu",
                    do_sample=False,
                    sampling=greedy,
                    state_slot=self._scoring_slot(),
                )
                steps.admit(chunk)
                batch = steps.batch_of(chunk)
                batch.logit_rows = torch.arange(stop - start, device=e.device.device)
                logits.append(e.pipeline.run([batch])[0].cpu())
            out.append(torch.cat(logits))
            steps.seqs.pop(seq_id)
            e.sampler.drop(seq_id)
            pages.free(seq_id)
        return out

    def _scoring_slot(self) -> tuple[str, int] | None:
        """The state slot `score` uses (no scheduled sequence holds one meanwhile)."""
        e = self.steps.engine
        if e.states is None:
            return None
        return next((tier, 0) for tier, n in e.running_state_slots().items() if n)


def score_prompt(chunk: SeqChunk, state: SeqState, logits: torch.Tensor) -> None:
    """Logprobs of a prompt chunk's tokens (echo + logprobs). logits: (q_len, vocab), row r
    predicting position start_pos + r + 1; the prediction for the chunk's first token was
    left by the previous chunk. Position 0 has no logprob, as in OpenAI's API."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # stays on the compute device
    k = state.sampling.logprobs
    if state.pending_logprobs is not None:
        state.prompt_logprobs += top_logprobs(state.pending_logprobs, chunk.token_ids[:1], [k])
    later = chunk.token_ids[1:]
    state.prompt_logprobs += top_logprobs(log_probs[: len(later)], later, [k] * len(later))
    state.pending_logprobs = log_probs[-1:]


def pool(
    pooler: Pooler | None, rows: list[torch.Tensor], seq_ids: list[int]
) -> dict[int, list[float]]:
    """Pooling requests' answers by sequence id, from their head rows ((width,) each)."""
    if not rows:
        return {}
    assert pooler is not None, "a pooling request on a generation model"
    outputs = pooler.outputs(torch.stack(rows).float())
    return dict(zip(seq_ids, outputs, strict=True))
