"""`ParentRequest`: a request for n choices as n engine requests of one choice each (torch-free).

The one fan-out of `n` (vLLM's parent request): the engine runs every request with n == 1;
`LLM` and the daemon's engine client hand it a parent's children and map the children's
deltas back to choice indices. The children share a `Request.group`, so the scheduler
computes their prompt once and forks its KV. Choice i samples with seed + i when a seed is set, so a
seeded request is reproducible whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

from engine.core.outputs import ChoiceAccumulator, RequestOutput, SequenceDelta
from engine.core.sequence import Request


class ParentRequest:
    """One caller's request and its children; `add` sums a child's deltas into its choice."""

    def __init__(self, request: Request) -> None:
        self.request = request
        n = request.sampling.n
        self.children: list[Request] = [request] if n == 1 else [self._child(i) for i in range(n)]
        """The engine requests, in choice order; with n == 1 the request itself."""
        self.choices = [ChoiceAccumulator(i) for i in range(n)]
        self._index = {child.request_id: i for i, child in enumerate(self.children)}

    def _child(self, index: int) -> Request:
        base = self.request.sampling
        seed = None if base.seed is None else base.seed + index
        sampling = dataclasses.replace(base, n=1, seed=seed)
        request_id = f"{self.request.request_id}-{index}"
        return dataclasses.replace(
            self.request, request_id=request_id, sampling=sampling, group=self.request.request_id
        )

    def index_of(self, child_id: str) -> int:
        """The choice index of the child `child_id`."""
        return self._index[child_id]

    def tag(self, delta: SequenceDelta) -> SequenceDelta:
        """`delta` with its choice index set."""
        delta.index = self._index[delta.request_id]
        return delta

    def add(self, delta: SequenceDelta) -> ChoiceAccumulator:
        """Sum a child's delta into its choice; the choice."""
        choice = self.choices[self.tag(delta).index]
        choice.add(delta)
        return choice

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    def output(self) -> RequestOutput:
        """The request with every choice as added up so far (`LLM`'s record)."""
        wants_logprobs = self.request.sampling.logprobs is not None
        first = self.choices[0]
        return RequestOutput(
            self.request.request_id,
            list(self.request.prompt_token_ids),
            [choice.output(wants_logprobs) for choice in self.choices],
            self.finished,
            first.prompt_logprobs,
            first.num_cached_tokens,
        )
