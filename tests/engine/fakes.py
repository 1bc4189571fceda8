"""A fake executor and detokenizer for scheduler tests: deterministic, torch-free, strict.

The fake keeps each sequence's tokens as its "KV cache" and checks every plan
the way a real engine relies on it: chunks start where the KV ends, sampling
arrives with a sequence's first chunk, page tables cover the tokens, no page
is shared by two live sequences, and no placeholder token reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.protocol import PENDING_TOKEN_ID, StepPlan, StepResult, TokenLogprobs
from engine.core.sampling_params import SamplingParams

VOCAB = 50


def next_token(history: list[int], seed: int | None) -> int:
    """The fake model: the next token is a fixed function of the sequence so far."""
    acc = seed or 0
    for i, token in enumerate(history):
        acc = (acc * 31 + token * (i + 7)) % 1_000_003
    return acc % VOCAB


def reference(prompt: list[int], max_tokens: int, seed: int | None = None) -> list[int]:
    """What a sequence generates without any stop condition but max_tokens."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, seed))
    return tokens[len(prompt) :]


@dataclass
class FakeExecutor:
    page_tokens: int = 16
    history: dict[int, list[int]] = field(default_factory=dict)
    sampling: dict[int, SamplingParams] = field(default_factory=dict)
    pages: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.freed_seq_ids:
            assert seq_id in self.history, f"freed unknown sequence {seq_id}"
            del self.history[seq_id], self.sampling[seq_id], self.pages[seq_id]
            self.freed.append(seq_id)
        seq_ids, token_ids, logprobs = [], [], []
        for chunk in plan.chunks:
            assert PENDING_TOKEN_ID not in chunk.token_ids, "placeholder reached the engine"
            if chunk.seq_id not in self.history:
                assert chunk.sampling is not None, "first chunk must carry sampling"
                assert chunk.start_pos == 0
                self.history[chunk.seq_id] = []
                self.sampling[chunk.seq_id] = chunk.sampling
                self.pages[chunk.seq_id] = (chunk.kv_tier, [])
            else:
                assert chunk.sampling is None, "sampling sent twice"
            history = self.history[chunk.seq_id]
            assert chunk.start_pos == len(history), (chunk.start_pos, len(history))
            history.extend(chunk.token_ids)
            tier, table = self.pages[chunk.seq_id]
            assert tier == chunk.kv_tier
            table.extend(chunk.new_page_ids)
            assert len(table) == -(-len(history) // self.page_tokens), "page table size"
            if chunk.do_sample:
                seed = self.sampling[chunk.seq_id].seed
                token = next_token(history, seed)
                seq_ids.append(chunk.seq_id)
                token_ids.append(token)
                logprobs.append(TokenLogprobs(token, -0.5, [(token, -0.5)]))
        self._check_pages_disjoint()
        return StepResult(plan.step_id, seq_ids, token_ids, logprobs)

    def _check_pages_disjoint(self) -> None:
        seen: set[tuple[str, int]] = set()
        for tier, table in self.pages.values():
            for page_id in table:
                assert (tier, page_id) not in seen, f"page {tier}:{page_id} shared"
                seen.add((tier, page_id))


class FakeDetokenizer:
    """Token t is the letter chr(ord('a') + t % 26)."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)
