"""`BatchBuilder`: turns one GPU batch's chunks into a `GpuBatch` (engine/executor/gpu_batch.py).

Flat token rows plus, once for every layer of the step, where each row's KV and activations
live and where it attends; every index list staged in host memory and moved to the device in
one copy (engine/executor/step_inputs.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.prefix_cache import PageRef
from engine.core.protocol import SeqChunk
from engine.executor.attention import RaggedLayout, Spans, padded_rows
from engine.executor.gpu_batch import (
    AttentionGroup,
    GpuBatch,
    RowHomes,
    SeqState,
    StateRows,
    TokenRows,
    slot_runs,
)
from engine.executor.image_rows import ImageRows, mrope_rows
from engine.executor.step_inputs import Staged, StepInputs
from engine.models.base import Positions
from engine.models.config import shared_window
from engine.storage.kv_store import KVRows

SlotsByTier = dict[str, tuple[list[int], list[int]]]
"""tier -> (pool slots, the rows they go to or come from)."""


def add_slots(
    out: SlotsByTier, pages: list[PageRef], start: int, stop: int, page_tokens: int, row: int
) -> None:
    """Add the pool slots of tokens [start, stop) of a sequence with page table `pages` to
    `out`, per tier, paired with rows row, row + 1, ... (a page at a time)."""
    t = start
    while t < stop:
        tier, page = pages[t // page_tokens]
        offset = t % page_tokens
        n = min(page_tokens - offset, stop - t)
        slots, rows = out.setdefault(tier, ([], []))
        first = page * page_tokens + offset
        slots.extend(range(first, first + n))
        rows.extend(range(row, row + n))
        t, row = t + n, row + n


def page_slots(pages: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """(B, W) the pool slot of each token position of B sequences, from their (B, W /
    page_tokens) page tables padded with their last page (`padded_rows`; a shorter
    sequence's tail repeats its last page's slots, never read)."""
    offsets = torch.arange(page_tokens, device=pages.device)
    return (pages[:, :, None] * page_tokens + offsets).view(pages.shape[0], -1)


class BatchBuilder:
    """Turns one GPU batch's chunks into a `GpuBatch`: flat token rows plus, once for every
    layer of the step, where each row's KV and activations live and where it attends."""

    def __init__(
        self,
        device: torch.device,
        page_tokens: int,
        *,
        cpu_attention: bool,
        windows: tuple[int, ...] = (0,),
        pool_device: Callable[[str], torch.device],
        positions: Callable[[torch.Tensor], Positions] = Positions,
        paged_attention: bool = False,
        inputs: StepInputs | None = None,
        mrope: bool = False,
    ) -> None:
        self.device, self.page_tokens = device, page_tokens
        self.cpu_attention = cpu_attention
        self.windows = windows
        """The distinct sliding windows of the model's layers (0: none): a layout for each."""
        self.shared_window = shared_window(windows)
        """The window of every layer, where they share one: then a sequence attends only over
        its last window - 1 past tokens, and only those are gathered, read or loaded."""
        self.pool_device = pool_device
        self.positions = positions
        """(T,) positions -> `Positions` with the model's tables (`Model.positions`)."""
        self.paged_attention = paged_attention
        """The device group reads its KV in place from the gpu tier's pool when all of it is
        there (`engine.executor.attention.paged_attention`); False: always packed."""
        self.inputs = inputs or StepInputs(device, pinned=device.type == "cuda")
        """The step's index inputs, staged and copied at once (engine/executor/step_inputs.py);
        the sampler may have staged its draws into it first."""
        self.mrope = mrope
        """Positions are (t, h, w) rows (M-RoPE, `image_rows.mrope_rows`), staged (T, 3)."""

    def build(
        self, index: int, chunks: list[tuple[SeqChunk, SeqState]], num_padding: int = 0
    ) -> GpuBatch:
        """One GPU batch (`build_step` of one)."""
        self.inputs.begin_step()
        return self.build_step([(index, chunks, num_padding)])[0]

    def build_step(
        self, specs: list[tuple[int, list[tuple[SeqChunk, SeqState]], int]]
    ) -> list[GpuBatch]:
        """The step's GPU batches, each from (index, its chunks, its padding rows): every
        index list of every batch staged in host memory first, then moved to the device in
        one copy (`StepInputs`), then the batches made from views of it. The caller has
        begun the step (`StepInputs.begin_step`)."""
        makers = [self._stage(*spec) for spec in specs]
        self.inputs.flush()
        return [make() for make in makers]

    def _stage(
        self, index: int, chunks: list[tuple[SeqChunk, SeqState]], num_padding: int
    ) -> Callable[[], GpuBatch]:
        """Flatten the chunks of one GPU batch into token rows and stage, once for every
        layer of the step, where each row's KV and activations live and where its attention
        runs. `num_padding` rows follow the chunks' rows (discrete batching): they go through
        the dense ops only (no attention, no KV, no logits) and stay on the compute device.
        Returns what makes the `GpuBatch` once the staged lists are on the device."""
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        logit_counts: list[int] = []
        act_rows: dict[str, list[int]] = {}
        new_kv: SlotsByTier = {}  # tier -> (slots, batch rows)
        members: dict[bool, list[tuple[SeqChunk, SeqState, int]]] = {False: [], True: []}
        spans: list[tuple[int, int]] = []
        state_slots: dict[str, tuple[list[int], list[int]]] = {}  # tier -> (slots, positions)
        images = ImageRows()
        row = 0
        for c, state in chunks:
            if state.state is not None:
                slots, order = state_slots.setdefault(state.state[0], ([], []))
                slots.append(state.state[1])
                order.append(len(spans))
                spans.append((row, len(c.token_ids)))
            q_len, ctx = len(c.token_ids), c.start_pos
            token_ids.extend(c.token_ids)
            if self.mrope:
                positions.extend(mrope_rows(state.media, ctx, q_len))
            else:
                positions.extend(range(ctx, ctx + q_len))
            if state.media is not None:
                images.add(state.media, state.image_features, ctx, q_len, row)
            act_rows.setdefault(state.act_tier, []).extend(range(row, row + q_len))
            add_slots(new_kv, state.pages, ctx, ctx + q_len, self.page_tokens, row)
            members[self.attends_on_cpu(c, state)].append((c, state, row))
            if state.wants_prompt_logprobs:
                logit_rows.extend(range(row, row + q_len))
                logit_counts.append(q_len)
            elif c.do_sample:
                logit_rows.append(row + q_len - 1)
                logit_counts.append(1)
            else:
                logit_counts.append(0)
            row += q_len
        if num_padding:
            token_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding * (3 if self.mrope else 1))
            act_rows.setdefault("gpu", []).extend(range(row, row + num_padding))
        num_rows = row + num_padding
        stage = self._stage_index
        staged_ids, staged_positions, staged_logits = (
            stage(token_ids),
            stage(positions),
            stage(logit_rows),
        )
        kv = {tier: self._stage_kv_rows(tier, *slots_rows) for tier, slots_rows in new_kv.items()}
        acts = {} if set(act_rows) == {"gpu"} else {t: stage(r) for t, r in act_rows.items()}
        states = {
            tier: (self._stage_pool_index(tier, slots), stage(order))
            for tier, (slots, order) in state_slots.items()
        }
        image_rows = (stage(images.rows), images.features(self.device)) if images.rows else None
        device_group = self._stage_group(members[False], num_rows, self.device)
        cpu_group = self._stage_group(members[True], num_rows, torch.device("cpu"))
        tensor = self.inputs.tensor

        def make() -> GpuBatch:
            position_ids = tensor(staged_positions)
            return GpuBatch(
                index=index,
                tokens=TokenRows(
                    ids=tensor(staged_ids),
                    positions=self.positions(
                        position_ids.view(-1, 3) if self.mrope else position_ids
                    ),
                    num_padding=num_padding,
                    images=None if image_rows is None else (tensor(image_rows[0]), image_rows[1]),
                ),
                logit_rows=tensor(staged_logits),
                logit_counts=logit_counts,
                device_group=device_group(),
                cpu_group=cpu_group(),
                homes=RowHomes(
                    new_kv={tier: make_rows() for tier, make_rows in kv.items()},
                    act_rows={tier: tensor(rows) for tier, rows in acts.items()},
                    states=StateRows(
                        spans,
                        {tier: (slots(), tensor(order)) for tier, (slots, order) in states.items()},
                        {tier: slot_runs(*order) for tier, order in state_slots.items()},
                    )
                    if spans
                    else None,
                ),
            )

        return make

    def past_start(self, chunk: SeqChunk) -> int:
        """The first past token the chunk's attention can see: the first the shared window
        keeps for its first query, else 0."""
        if not self.shared_window:
            return 0
        return max(0, chunk.start_pos - (self.shared_window - 1))

    def past_len(self, chunk: SeqChunk) -> int:
        """Past tokens the chunk attends over (and its attention group gathers)."""
        return chunk.start_pos - self.past_start(chunk)

    def layouts(
        self,
        q_lens: list[int],
        past_lens: list[int],
        where: torch.device,
        seq_slots: torch.Tensor | None = None,
        spans: list[Spans] | None = None,
    ) -> dict[int, RaggedLayout]:
        """One `RaggedLayout` per window of the model's layers; `spans` as `image_spans`."""
        return {
            w: RaggedLayout.build(q_lens, past_lens, where, w or None, seq_slots, spans)
            for w in self.windows
        }

    def image_spans(self, chunk: SeqChunk, state: SeqState) -> Spans:
        """The key ranges (the layout's positions, from `past_start`) of the images whose
        tokens the chunk runs and whose tokens attend to each other both ways (Gemma 3)."""
        media = state.media
        if media is None or not media.bidirectional:
            return ()
        first, end = self.past_start(chunk), chunk.start_pos + len(chunk.token_ids)
        return tuple(
            (i.start - first, i.start + i.num_tokens - first)
            for i in media.images
            if i.start < end and i.start + i.num_tokens > chunk.start_pos
        )

    def attends_on_cpu(self, chunk: SeqChunk, state: SeqState) -> bool:
        """FlexGen Sec. 4.2: decode attention over host-homed KV (cpu, or disk read into host
        memory) runs on the CPU; only q and the new k, v cross PCIe."""
        return self.cpu_attention and state.kv_tier != "gpu" and len(chunk.token_ids) == 1

    def _stage_group(
        self, members: list[tuple[SeqChunk, SeqState, int]], num_rows: int, where: torch.device
    ) -> Callable[[], AttentionGroup | None]:
        """Stage the attention inputs of sequences attending on `where`: their rows, and
        their page tables when they read the gpu tier in place; returns what makes the
        group (the padding layout, and per tier the slots of their past tokens packed in
        sequence order, built on first use) once they are on the device."""
        if not members:
            return lambda: None
        q_lens = [len(c.token_ids) for c, _, _ in members]
        past_lens = [self.past_len(c) for c, _, _ in members]
        spans = [self.image_spans(c, state) for c, state, _ in members]

        def build_past() -> dict[str, KVRows]:
            past: SlotsByTier = {}
            packed = 0
            for c, state, _ in members:  # a cached prefix may sit on other tiers than the home
                first = self.past_start(c)
                add_slots(past, state.pages, first, c.start_pos, self.page_tokens, packed)
                packed += c.start_pos - first
            return {tier: self._kv_rows(tier, *slots_dest) for tier, slots_dest in past.items()}

        rows: Staged | None = None
        if sum(q_lens) != num_rows:
            rows = self._stage_index(
                [r for c, _, start in members for r in range(start, start + len(c.token_ids))]
            )
        tables = None
        if self.paged_attention and where == self.device:
            tables = self._stage_gpu_pages(members)

        def make() -> AttentionGroup:
            return AttentionGroup(
                rows=None if rows is None else self.inputs.tensor(rows),
                layouts=self.layouts(
                    q_lens, past_lens, where, None if tables is None else tables(), spans
                ),
                build_past=build_past,
            )

        return make

    def _stage_gpu_pages(
        self, members: list[tuple[SeqChunk, SeqState, int]]
    ) -> Callable[[], torch.Tensor] | None:
        """Stage, per sequence, the gpu tier's pages of all the tokens it attends over (past
        from `past_start`, and new) and where in its first page they start; returns what
        makes the (B, W) table of their pool slots from them on the device (`page_slots`).
        None when any of those pages lives on another tier."""
        size = self.page_tokens
        tables, offsets = [], []
        for c, state, _ in members:
            first = self.past_start(c)
            pages = state.pages[first // size : -(-(c.start_pos + len(c.token_ids)) // size)]
            if any(tier != "gpu" for tier, _ in pages):
                return None
            tables.append([page for _, page in pages])
            offsets.append(first % size)
        padded, width = padded_rows(tables)
        staged_pages = self._stage_index(padded)
        staged_offsets = self._stage_index(offsets) if any(offsets) else None

        def make() -> torch.Tensor:
            pages = self.inputs.tensor(staged_pages).view(len(tables), width)
            table = page_slots(pages, size)
            if staged_offsets is None:
                return table
            # row b's tokens start offsets[b] slots into its first page (columns past its
            # length are never read)
            columns = table.shape[1]
            shift = self.inputs.tensor(staged_offsets)[:, None]
            at = (torch.arange(columns, device=self.device)[None, :] + shift).clamp(max=columns - 1)
            return table.gather(1, at)

        return make

    def _stage_index(self, values: list[int]) -> Staged:
        return self.inputs.stage(values, torch.long)

    def _stage_pool_index(self, tier: str, values: list[int]) -> Callable[[], torch.Tensor]:
        """Stage indices into a tier's pool: read on the compute device, or in host memory
        for a pool that lives there."""
        staged = self._stage_index(values)
        if self.pool_device(tier) == self.device:
            return lambda: self.inputs.tensor(staged)
        return lambda: self.inputs.host(staged)

    def _stage_kv_rows(self, tier: str, slots: list[int], rows: list[int]) -> Callable[[], KVRows]:
        slot_index = None if tier == "disk" else self._stage_pool_index(tier, slots)
        staged_rows = self._stage_index(rows)
        return lambda: KVRows(
            slots, None if slot_index is None else slot_index(), self.inputs.tensor(staged_rows)
        )

    def _kv_rows(self, tier: str, slots: list[int], rows: list[int]) -> KVRows:
        """KV rows made on first use inside the step (a packed past): their own copies."""
        slot_index = (
            None
            if tier == "disk"
            else torch.tensor(slots, dtype=torch.long, device=self.pool_device(tier))
        )
        return KVRows(slots, slot_index, torch.tensor(rows, dtype=torch.long, device=self.device))
