"""Nano-batches (NanoFlow 4.3): a GPU batch's sequences cut into a few runs whose decoder-layer
operations overlap (`engine/executor/nano_overlap.py`). Cut once per step, used by every layer.

A nano-batch is a run of whole, consecutive sequences of its GPU batch, because attention
needs whole sequences. So its rows are one contiguous slice of the batch's rows, and its
sequences' past KV one contiguous slice of each attention group's past, which the block
pipeline loads once per (layer, GPU batch) packed in sequence order: nano-batching moves no
byte more than the whole batch does.

Sizes need not be equal. Each cut balances two shares at once: of the batch's token rows (the
dense ops' work) and of its query-key pairs (attention's work), so a long prefill chunk or a
sequence with a long past weighs what it costs. One split serves every operation group
(docs/architecture.md, "Nano-batches", says why). A batch with fewer sequences than nano-batches
gets one nano-batch per sequence; one sequence is not split at all.
"""

from __future__ import annotations

from itertools import accumulate, pairwise

import torch

from engine.core.protocol import SeqChunk
from engine.executor.batch_builder import BatchBuilder
from engine.executor.gpu_batch import (
    GpuBatch,
    NanoAttention,
    NanoBatch,
    SeqState,
)


def balanced_cuts(weights: list[float], num_groups: int) -> list[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_m = n of m = min(num_groups, n) contiguous, non-empty
    groups of the n weights, each b_g the cut whose cumulative weight is closest to g/m of the
    total."""
    n = len(weights)
    m = min(num_groups, n)
    cum = [0.0, *accumulate(weights)]
    cuts = [0]
    for g in range(1, m):
        lowest, highest = cuts[-1] + 1, n - (m - g)  # leave one item for each later group
        target = cum[n] * g / m
        cuts.append(min(range(lowest, highest + 1), key=lambda c: abs(cum[c] - target)))
    return [*cuts, n]


def attention_pairs(q_len: int, past_len: int, window: int | None) -> int:
    """Query-key pairs a chunk's causal attention scores (its attention work)."""
    pairs = q_len * past_len + q_len * (q_len + 1) // 2
    return pairs if window is None else min(pairs, q_len * window)


class NanoBatcher:
    """Cuts each GPU batch of a step into `num_nano_batches` nano-batches."""

    def __init__(self, num_nano_batches: int, builder: BatchBuilder) -> None:
        assert num_nano_batches >= 2
        self.num_nano_batches, self.builder = num_nano_batches, builder

    def split(self, batch: GpuBatch, chunks: list[tuple[SeqChunk, SeqState]]) -> list[NanoBatch]:
        """The nano-batches of `batch`, built from the same chunks in the same order; empty
        when it has a single sequence (its layers then run it whole)."""
        if len(chunks) < 2:
            return []
        q_lens = [len(c.token_ids) for c, _ in chunks]
        past_lens = [self.builder.past_len(c) for c, _ in chunks]
        window = self.builder.shared_window or None
        pairs = [attention_pairs(q, p, window) for q, p in zip(q_lens, past_lens, strict=True)]
        total_rows, total_pairs = batch.num_tokens, max(1, sum(pairs))
        weights = [q / total_rows + p / total_pairs for q, p in zip(q_lens, pairs)]
        weights[-1] += batch.num_padding / total_rows  # padding rows ride with the last chunk
        cuts = balanced_cuts(weights, self.num_nano_batches)
        on_cpu = [self.builder.attends_on_cpu(c, state) for c, state in chunks]
        starts = [0, *accumulate(q_lens)]  # each chunk's first row in the batch
        past_before = {False: 0, True: 0}  # past rows of earlier sequences, per group
        out = []
        for index, (first, stop) in enumerate(pairwise(cuts)):
            num_rows = starts[stop] - starts[first]
            if stop == len(chunks):
                num_rows += batch.num_padding
            parts: dict[bool, NanoAttention | None] = {}
            for cpu in (False, True):
                members = [i for i in range(first, stop) if on_cpu[i] == cpu]
                parts[cpu] = self._part(members, chunks, starts, first, num_rows, past_before[cpu])
                past_before[cpu] += sum(past_lens[i] for i in members)
            rows = slice(starts[first], starts[first] + num_rows)
            out.append(NanoBatch(index, rows, parts[False], parts[True]))
        return out

    def _part(
        self,
        members: list[int],
        chunks: list[tuple[SeqChunk, SeqState]],
        starts: list[int],
        first: int,
        num_rows: int,
        past_start: int,
    ) -> NanoAttention | None:
        """The attention of the chunks `members` (indices into `chunks`), whose nano-batch
        begins at chunk `first` and has `num_rows` rows."""
        if not members:
            return None
        q_lens = [len(chunks[i][0].token_ids) for i in members]
        past_lens = [self.builder.past_len(chunks[i][0]) for i in members]
        on_cpu = self.builder.attends_on_cpu(*chunks[members[0]])
        where = torch.device("cpu") if on_cpu else self.builder.device
        rows = None
        if sum(q_lens) != num_rows:
            offset = starts[first]
            local = [r - offset for i in members for r in range(starts[i], starts[i + 1])]
            rows = torch.tensor(local, dtype=torch.long, device=self.builder.device)
        return NanoAttention(
            rows=rows,
            layouts=self.builder.layouts(
                q_lens,
                past_lens,
                where,
                spans=[self.builder.image_spans(*chunks[i]) for i in members],
            ),
            past=slice(past_start, past_start + sum(past_lens)),
        )
