"""`GrammarBank`: the llguidance matcher of each structured-output sequence, in the engine.

A sequence's matcher is built off the step loop, on a thread of its own, when its first
chunk arrives (the grammar text is checked by the daemon before; engine/core/structured.py),
and the step that first samples it waits for it (`BUILD_SECONDS` at most). Each step the
constrained rows' token masks are computed together on llguidance's own threads (one bit
per token: (rows, ceil(vocab / 32)) int32) while the layers run (`StepSampler.prepare`),
and each sampled token advances its matcher.
A preempted sequence loses its matcher with the rest of its engine state; when it runs
again its output so far is replayed into a new one before its next mask.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from engine.core.structured import StructuredOutput

MAX_TEMPLATES = 256
"""Constraints whose fresh matcher is kept for the next sequence that asks for them."""
BUILD_SECONDS = 30.0
"""The most the first sampling of a sequence waits for its matcher (then it fails alone)."""


class GrammarError(RuntimeError):
    """A sequence's grammar failed inside a step: the sequence fails, the step goes on."""


class GrammarBank:
    """Matchers by sequence id. `tokenizer_json`: the model's tokenizer.json text source;
    `vocab_size`: the logits' width (ids past the tokenizer's are never allowed)."""

    def __init__(
        self, tokenizer_path: Path, vocab_size: int, eos_ids: tuple[int, ...], num_threads: int
    ) -> None:
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        """llguidance's threads for a step's masks (1 beside a CPU's forward pass)."""
        self._tokenizer_path = tokenizer_path
        self._eos_ids = list(eos_ids)
        self._builds = ThreadPoolExecutor(1, thread_name_prefix="nanoflex-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Future[Any] | None = None
        self._matchers: dict[int, Future[Any]] = {}
        self._templates: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        """A fresh matcher per constraint (the most recent `MAX_TEMPLATES`): a sequence's
        own is a copy of it, which costs far less than building one from the grammar."""
        self._parallel: Any = None  # llguidance.LLExecutor, made on first use

    def _llm_tokenizer(self) -> Any:
        from llguidance import LLTokenizer

        text = self._tokenizer_path.read_text()
        return LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos_ids or None)

    def add(self, seq_id: int, spec: StructuredOutput) -> None:
        """Start building the matcher of a newly admitted sequence: a copy of its
        constraint's fresh matcher, built the first time the constraint is seen."""
        with self._lock:
            if self._tokenizer is None:  # about a second, once: on the same build thread
                self._tokenizer = self._builds.submit(self._llm_tokenizer)
            template = self._templates.get(spec)
            if template is None:
                template = self._builds.submit(self._build, self._tokenizer, spec)
                self._templates[spec] = template
                if len(self._templates) > MAX_TEMPLATES:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(spec)
        self._matchers[seq_id] = self._builds.submit(_copy, template)

    @staticmethod
    def _build(tokenizer: Future[Any], spec: StructuredOutput) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(tokenizer.result(), spec.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return matcher

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def _matcher(self, seq_id: int) -> Any:
        try:
            return self._matchers[seq_id].result(BUILD_SECONDS)
        except FutureTimeout as e:
            raise GrammarError(f"the grammar took over {BUILD_SECONDS:g} s to build") from e

    def replay(self, seq_id: int, token_ids: list[int]) -> None:
        """Feed a recomputed sequence's output so far to its new matcher."""
        matcher = self._matcher(seq_id)
        if token_ids and not matcher.consume_tokens(token_ids):
            raise GrammarError(f"replaying the output failed: {matcher.get_error()}")

    def masks(self, seq_ids: list[int]) -> tuple[torch.Tensor, dict[int, str]]:
        """(len(seq_ids), ceil(vocab / 32)) int32 allowed-token bits, one row per sequence
        (all ones for one that failed), and the failures by sequence id."""
        from llguidance import LLExecutor
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        bits = allocate_token_bitmask(len(seq_ids), self.vocab_size)
        ready: list[tuple[Any, int]] = []
        errors: dict[int, str] = {}
        for row, seq_id in enumerate(seq_ids):
            try:
                ready.append((self._matcher(seq_id), row))
            except GrammarError as e:
                errors[seq_id] = str(e)
        if ready:
            if self._parallel is None:
                self._parallel = LLExecutor(self.num_threads)
            fill_next_token_bitmask_par(self._parallel, ready, bits)
        for matcher, row in ready:
            if matcher.is_error():
                errors[seq_ids[row]] = f"structured output failed: {matcher.get_error()}"
                bits[row] = -1
        return bits, errors

    def advance(self, seq_id: int, token_id: int) -> str | None:
        """Consume the sampled token; an error message where the matcher cannot."""
        matcher = self._matcher(seq_id)
        if matcher.consume_token(token_id):
            return None
        return f"structured output failed: {matcher.get_error()}"

    def close(self) -> None:
        self._builds.shutdown(wait=False, cancel_futures=True)


def _copy(template: Future[Any]) -> Any:
    """A sequence's own matcher: a copy of its constraint's fresh one (which never consumes
    a token), or the error that building it raised."""
    return template.result().deep_copy()
