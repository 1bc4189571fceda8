"""`StepSampler`: one step's sampling: the logits stage, the sampler, and what they keep per
sequence (its tokens, for penalties and structured outputs; its grammar matcher)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engine.core.model_files import eos_token_ids
from engine.core.protocol import SeqChunk, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.executor.grammar import GrammarBank, GrammarError
from engine.executor.logits import LogitsProcessor, Masks, RowTokens
from engine.executor.sampler import Sampler
from engine.executor.step_inputs import StepInputs
from engine.executor.tasks import wait_all
from engine.kernels import TokenMask


class StepSampler:
    """Samples each step's rows. Sequences whose settings read their tokens (penalties,
    min_tokens, bad words, structured outputs) have them kept here from their first chunk;
    a preempted sequence is dropped and, when it runs again, its first chunks bring its
    output back as part of its prompt (`SeqChunk.num_sampled` says how much of it).

    `prepare` starts the step's grammar masks on a worker thread before the layers run
    (they depend only on the tokens sampled before), so that on a GPU they cost the step
    nothing; `sample` waits for them. `overlap_masks` False: `sample` computes them itself,
    after the layers (on a CPU the worker would take a core from the forward pass's
    threads, which then wait for each other). `grammar_threads`: llguidance's threads.
    `inputs`: the step's inputs, which `prepare` stages the draws into before the batches'
    copy (engine/executor/step_inputs.py); None: `sample` copies them itself."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        token_mask: TokenMask | None,
        grammar_threads: int = 1,
        overlap_masks: bool = True,
        inputs: StepInputs | None = None,
    ) -> None:
        eos = eos_token_ids(model_dir)
        tokenizer = model_dir / "tokenizer.json"
        self.grammars = (
            GrammarBank(tokenizer, vocab_size, eos, grammar_threads)
            if tokenizer.is_file()
            else None
        )
        self.logits = LogitsProcessor(vocab_size, eos, self.grammars, token_mask)
        self.sampler = Sampler(inputs=inputs)
        self.vocab_size = vocab_size
        self.uses_inputs = inputs is not None
        """`prepare` stages the draws into the step's inputs (the caller copies them)."""
        self._tokens: dict[int, list[int]] = {}
        """Sequence id -> every token it has fed, for those whose settings read them."""
        self.overlap_masks = overlap_masks
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="nanoflex-masks")
        self._pending: tuple[list[RowTokens], list[int], list[RowTokens], bool] | None = None
        """The prepared step: its rows, tokens sampled per row, rows to replay into a new
        matcher, whether any row is constrained (needs masks)."""
        self._masks_ahead: Future[Masks] | None = None
        """The pending step's masks, building on the worker (`overlap_masks`)."""
        self.mask_seconds = 0.0
        """Time spent building grammar masks, on the worker
        (bench/features/structured_outputs.py)."""
        self.mask_wait_seconds = 0.0
        """Time `sample` waited for them: what they added to the steps."""

    def admit(self, seq_id: int, sampling: SamplingParams) -> None:
        """A sequence's first chunk (again after a preemption)."""
        if sampling.needs_history:
            self._tokens[seq_id] = []
        if sampling.structured is not None and self.grammars is not None:
            self.grammars.add(seq_id, sampling.structured)

    def feed(self, chunk: SeqChunk) -> None:
        tokens = self._tokens.get(chunk.seq_id)
        if tokens is not None:
            tokens.extend(chunk.cached_token_ids)  # a cached prefix, with the first chunk
            tokens.extend(chunk.token_ids)

    def drop(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.drop(seq_id)

    def prepare(
        self, chunks: list[SeqChunk], params: list[SamplingParams], first: list[bool]
    ) -> None:
        """The rows this step samples (the sampled chunks, their settings, whether each is
        its first sampling since it was admitted): start their grammar masks."""
        rows = []
        for chunk, p in zip(chunks, params, strict=True):
            tokens = self._tokens.get(chunk.seq_id, [])
            split = len(tokens) - chunk.num_sampled
            rows.append(RowTokens(chunk.seq_id, p, tokens[split:], tokens[:split]))
        replays = [
            row
            for row, chunk, is_first in zip(rows, chunks, first, strict=True)
            if is_first and chunk.num_sampled and row.params.structured is not None
        ]
        num_sampled = [c.num_sampled for c in chunks]
        constrained = any(row.params.structured is not None for row in rows)
        if rows and self.uses_inputs:
            self.sampler.prepare(params, num_sampled, self.vocab_size)
        self._pending = (rows, num_sampled, replays, constrained)
        if constrained and self.overlap_masks:
            self._masks_ahead = self._worker.submit(self._masks, rows, replays)

    def _masks(self, rows: list[RowTokens], replays: list[RowTokens]) -> Masks:
        start = time.perf_counter()
        try:
            return self._replay_and_mask(rows, replays)
        finally:
            self.mask_seconds += time.perf_counter() - start

    def _replay_and_mask(self, rows: list[RowTokens], replays: list[RowTokens]) -> Masks:
        failed: dict[int, str] = {}
        for row in replays:  # a recomputed sequence: its new matcher has not seen its output
            try:
                assert self.grammars is not None
                self.grammars.replay(row.seq_id, list(row.output_ids))
            except GrammarError as e:
                failed[row.seq_id] = str(e)
        bits, mask_failed = self.logits.masks([r for r in rows if r.seq_id not in failed])
        return bits, {**mask_failed, **failed}

    def sample(
        self, logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """Tokens for the prepared rows from `logits` (one row each, changed in place), their
        logprob records, and the sequences that failed (id -> message)."""
        assert self._pending is not None, "sample() without prepare()"
        rows, num_sampled, replays, constrained = self._pending
        ahead, self._pending, self._masks_ahead = self._masks_ahead, None, None
        start = time.perf_counter()
        if ahead is not None:
            masks = ahead.result()
        elif constrained:
            masks = self._masks(rows, replays)
        else:
            masks = ({}, {})
        self.mask_wait_seconds += time.perf_counter() - start
        token_ids, logprobs, errors = self.sampler.sample(
            logits,
            [row.params for row in rows],
            num_sampled,
            lambda x: self.logits.apply(x, rows, masks, check_empty=False),
        )
        failed = {rows[r].seq_id: message for r, message in errors.items()}
        ok = [r for r in range(len(rows)) if rows[r].seq_id not in failed]
        advanced = self.logits.advance([rows[r] for r in ok], [token_ids[r] for r in ok])
        for i, message in advanced.items():
            failed[rows[ok[i]].seq_id] = message
        return token_ids, logprobs, failed

    def discard(self) -> None:
        """The prepared step will not be sampled (it failed): wait for its masks, drop them."""
        ahead, self._pending, self._masks_ahead = self._masks_ahead, None, None
        self.sampler.discard()
        if ahead is not None:
            ahead.cancel()  # still queued: it never runs
            wait_all([ahead])

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()
