"""A fake executor and detokenizer for scheduler tests: deterministic, torch-free, strict.

The fake keeps each page's tokens as its "KV cache" and checks every plan the way a
real engine relies on it: chunks start where the KV ends, sampling arrives with a
sequence's first chunk, page tables cover the tokens, no page is written while another
live sequence holds it, moves and copies land in free pages, a fork samples where its
leader does, and no placeholder token reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.outputs import RequestOutput, SequenceDelta
from engine.core.parent_request import ParentRequest
from engine.core.prefix_cache import PageRef
from engine.core.protocol import PENDING_TOKEN_ID, StepPlan, StepResult, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

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


def prefill_tokens(plans: list[StepPlan], prompt_len: int) -> int:
    """Prompt positions the executor computed, over all plans."""
    return sum(
        max(0, min(c.start_pos + len(c.token_ids), prompt_len) - c.start_pos)
        for plan in plans
        for c in plan.chunks
    )


@dataclass
class FakeExecutor:
    """Holds each page's token ids as its "KV": a sequence's history is read back from the
    pages of its page table, so a page mapped wrong (a bad prefix hit, a lost move, a
    write into a shared page) changes its tokens and the outputs."""

    page_tokens: int = 16
    store: dict[PageRef, list[int | None]] = field(default_factory=dict)
    tables: dict[int, list[PageRef]] = field(default_factory=dict)
    homes: dict[int, str] = field(default_factory=dict)
    sampling: dict[int, SamplingParams] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.freed_seq_ids:
            assert seq_id in self.tables, f"freed unknown sequence {seq_id}"
            del self.tables[seq_id], self.sampling[seq_id], self.homes[seq_id]
            self.freed.append(seq_id)
        for move in plan.page_moves:
            assert move.src in self.store, f"moved page {move.src} holds nothing"
            assert not self._holders(move.dst), f"moved into page {move.dst}, which is held"
            self.store[move.dst] = self.store.pop(move.src)
        for copy in plan.page_copies:  # copy-on-write of a shared partial page
            table = self.tables[copy.seq_id]
            assert table[copy.index] == copy.src, f"copy of {copy.src} not in its table"
            assert not self._holders(copy.dst), f"copied into page {copy.dst}, which is held"
            self.store[copy.dst] = list(self.store[copy.src])
            table[copy.index] = copy.dst
        sampled_here = {c.seq_id for c in plan.chunks if c.do_sample and c.token_ids}
        seq_ids: list[int] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        for chunk in plan.chunks:
            assert PENDING_TOKEN_ID not in chunk.token_ids, "placeholder reached the engine"
            if chunk.forked_from is not None:  # its history is read from the shared pages
                assert chunk.forked_from in sampled_here, "forked from a row not sampled"
                assert not chunk.token_ids and chunk.seq_id not in self.tables
            if chunk.seq_id not in self.tables:
                assert chunk.sampling is not None, "first chunk must carry sampling"
                self.tables[chunk.seq_id] = []
                self.homes[chunk.seq_id] = chunk.kv_tier
                self.sampling[chunk.seq_id] = chunk.sampling
            else:
                assert chunk.sampling is None, "sampling sent twice"
            assert self.homes[chunk.seq_id] == chunk.kv_tier
            table = self.tables[chunk.seq_id]
            table.extend(chunk.new_pages)
            history = self._read(table, chunk.start_pos)
            history.extend(chunk.token_ids)
            assert len(table) == -(-len(history) // self.page_tokens), "page table size"
            self._write(chunk.seq_id, table, chunk.start_pos, chunk.token_ids)
            if chunk.do_sample:
                seed = self.sampling[chunk.seq_id].seed
                token = next_token(history, seed)
                seq_ids.append(chunk.seq_id)
                token_ids.append(token)
                logprobs.append(TokenLogprobs(token, -0.5, [(token, -0.5)]))
        return StepResult(plan.step_id, seq_ids, token_ids, logprobs)

    def _read(self, table: list[PageRef], num_tokens: int) -> list[int]:
        """The tokens in KV positions [0, num_tokens) of a page table."""
        out: list[int] = []
        for t in range(num_tokens):
            token = self.store[table[t // self.page_tokens]][t % self.page_tokens]
            assert token is not None, f"position {t} read before it was written"
            out.append(token)
        return out

    def _write(self, seq_id: int, table: list[PageRef], start: int, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            t = start + i
            ref = table[t // self.page_tokens]
            assert ref[0] == self.homes[seq_id], "a sequence writes only its home tier"
            others = self._holders(ref) - {seq_id}
            assert not others, f"page {ref} written while sequences {others} hold it"
            page = self.store.setdefault(ref, [None] * self.page_tokens)
            if t % self.page_tokens == 0:  # a fresh page: forget its previous owner
                page[:] = [None] * self.page_tokens
            page[t % self.page_tokens] = token

    def _holders(self, ref: PageRef) -> set[int]:
        return {seq_id for seq_id, table in self.tables.items() if ref in table}


class FakeDetokenizer:
    """Token t is the letter chr(ord('a') + t % 26)."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


class Outputs:
    """The scheduler's deltas added up per request, as the engine's front does (a
    `ParentRequest` with one accumulator per choice): `add` after each `postprocess`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.parents: dict[str, ParentRequest] = {}

    def track(self) -> None:
        """Start following the requests added since (call before `postprocess`)."""
        for request_id, seq in self.scheduler.requests.items():
            if request_id not in self.parents:
                self.parents[request_id] = ParentRequest(seq.request)

    def add(self, deltas: list[SequenceDelta]) -> list[RequestOutput]:
        """Add one step's deltas; the outputs of the requests they changed, in their order."""
        for delta in deltas:
            self.parents[delta.request_id].add(delta)
        return [self.parents[d.request_id].output() for d in deltas]

    def final(self) -> dict[str, RequestOutput]:
        return {rid: p.output() for rid, p in self.parents.items() if p.finished}
