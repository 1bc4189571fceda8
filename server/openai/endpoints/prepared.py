"""`Prepared`: a request validated and tokenized by its endpoint, ready to run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.media import SeqMedia
from engine.core.outputs import ChoiceAccumulator
from engine.core.sampling_params import SamplingParams
from server.openai.embeddings import PoolingJob
from server.openai.responses_api import ResponsesRequest
from server.openai.tools import ToolPlan


@dataclass(slots=True)
class Prepared:
    """A validated, tokenized request, ready to run. Each prompt is one engine request of n
    choices; choice j of prompt i is the response's choice i * n + j."""

    is_chat: bool
    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    """One per prompt, with n (chat's default max_tokens depends on the prompt length)."""
    n: int
    echo: bool
    num_logprobs: int | None
    stream: bool
    include_usage: bool
    tokens_as_ids: bool = False
    """Logprobs name tokens "token_id:<id>" (`return_tokens_as_token_ids`)."""
    tools: ToolPlan | None = None
    """A chat's tools: the answer is read for calls (server/openai/tools.py)."""
    reasoning: str | None = None
    """The reasoning parser that splits a chat's answer (server/openai/parsers/reasoning.py)."""
    responses: ResponsesRequest | None = None
    """A Responses API request, run as the chat it means and answered as a Response."""
    pooling: PoolingJob | None = None
    """A pooling request (server/openai/embeddings.py): its inputs are `prompts`."""
    media: list[SeqMedia | None] | None = None
    """Each prompt's images (a chat with image parts); None: text alone."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def num_cached_tokens(self, choices: Iterable[ChoiceAccumulator]) -> int:
        """Cached prompt tokens, counted like `num_prompt_tokens`: once per prompt (its first
        choice's; with n > 1 the other choices fork its KV and report the same hit)."""
        return sum(c.num_cached_tokens for c in choices if c.index % self.n == 0)

    def prompt_index(self, choice: ChoiceAccumulator) -> int:
        return choice.index // self.n

    @property
    def num_seqs(self) -> int:
        """Engine requests this request becomes (prompts x n): what it takes of the queue."""
        return len(self.prompts) * self.n
