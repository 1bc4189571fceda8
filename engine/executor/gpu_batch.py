"""`GpuBatch`: one GPU batch of a step as flat token rows, with every index its layers need.

Built once per step by the executor; every layer of the step reuses it, so no
layer loops over sequences in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.media import SeqMedia
from engine.core.prefix_cache import PageRef
from engine.core.protocol import SeqChunk, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.executor.attention import RaggedLayout, padded_rows
from engine.executor.image_rows import ImageRows, mrope_rows
from engine.executor.step_inputs import Staged, StepInputs
from engine.models.base import Positions
from engine.models.config import shared_window
from engine.storage.kv_store import KVRows


@dataclass(slots=True)
class AttentionGroup:
    """The sequences of a batch whose attention runs on one device."""

    rows: torch.Tensor | None
    """(T_g,) batch rows of the group's new tokens on the compute device; None: every row."""
    layouts: dict[int, RaggedLayout]
    """Per sliding window of the model's layers (0: none), the padding indices and mask, on
    the device the group's attention runs on; they differ only in the mask."""
    build_past: Callable[[], dict[str, KVRows]]
    """Builds `past`, on first use: a group read in place never gathers its past, and
    listing every past token's slot each step costs as much as a layer's GEMMs."""
    _past: dict[str, KVRows] | None = None

    @property
    def layout(self) -> RaggedLayout:
        """A layout of the group, for what every window shares (rows, lengths, slots)."""
        return next(iter(self.layouts.values()))

    @property
    def past(self) -> dict[str, KVRows]:
        """Per tier: the slots of the group's past tokens and their rows in its packed past."""
        if self._past is None:
            self._past = self.build_past()
        return self._past


@dataclass(slots=True)
class NanoAttention:
    """The part of one nano-batch's attention that runs on one device."""

    rows: torch.Tensor | None
    """(T_a,) rows of the nano-batch (0 = its first) attending here; None: all of its rows."""
    layouts: dict[int, RaggedLayout]
    """Per sliding window of the model's layers (0: none), the padding indices and mask of
    these sequences, on the device their attention runs on."""
    past: slice
    """Their rows in the attention group's packed past KV (`PastKV.device` or `PastKV.cpu`)."""


@dataclass(slots=True)
class NanoBatch:
    """One nano-batch of a GPU batch: its rows and where each of its sequences attends."""

    index: int
    """0, 1, ... within its GPU batch (the trace's `nano_batch`)."""
    rows: slice
    """Its rows of the GPU batch: its sequences' tokens (the last nano-batch also the padding)."""
    device: NanoAttention | None
    """Its sequences attending on the compute device."""
    cpu: NanoAttention | None
    """Its decodes over host-homed KV attending on the CPU."""

    @property
    def num_rows(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass(slots=True)
class StateRows:
    """Where a batch's sequences keep their states (a hybrid model's state layers)."""

    spans: list[tuple[int, int]]
    """Per sequence, in batch order: (its first row, its rows)."""
    slots: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Per state tier: (its slots, on the pool's device; their sequences' positions in
    `spans`, on the compute device)."""
    runs: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Per state tier, the same as stretches of consecutive slots at consecutive positions:
    (first slot, first position, count): a host pool is copied by them (`StateStore`)."""


def slot_runs(slots: list[int], positions: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first position, count) of each stretch where consecutive `positions`
    hold consecutive `slots`, in order: one copy each instead of one per slot."""
    runs: list[tuple[int, int, int]] = []
    for slot, pos in zip(slots, positions, strict=True):
        if runs:
            first, at, n = runs[-1]
            if slot == first + n and pos == at + n:
                runs[-1] = (first, at, n + 1)
                continue
        runs.append((slot, pos, 1))
    return runs


@dataclass(slots=True)
class GpuBatch:
    """Everything a layer needs to run one GPU batch (T = new tokens, S = sampled rows)."""

    index: int
    token_ids: torch.Tensor
    """(T,) on the compute device."""
    positions: Positions
    """(T,) absolute positions on the compute device, with the model's tables for them."""
    logit_rows: torch.Tensor
    """(S,) rows whose next-token logits the head computes."""
    logit_counts: list[int]
    """Per chunk, in order: how many of the logit rows are its (its last row when it samples,
    every row when its prompt logprobs are wanted, none otherwise)."""
    device_group: AttentionGroup | None
    """Sequences attending on the compute device."""
    cpu_group: AttentionGroup | None
    """Decodes over cpu- or disk-homed KV attending on the CPU (FlexGen Sec. 4.2)."""
    new_kv: dict[str, KVRows]
    """Per tier: the slots for the new tokens' KV and their rows in the batch."""
    act_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """tier -> (rows,) indices of rows homed there; empty when every row stays on the gpu tier."""
    num_padding: int = 0
    """Rows after the chunks' rows that only pad the dense ops to the step's discrete size."""
    nano_batches: list[NanoBatch] = field(default_factory=list)
    """Its nano-batches (cut by engine/executor/nano_batches.py); empty: its layers run it whole."""
    states: StateRows | None = None
    """A hybrid model's: each sequence's rows and state slot; None: no state layers. State
    layers run the batch whole, nano-batches or not: each row reads and writes only its own
    sequence's state."""
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows (R,), features (R, hidden)): rows whose embedding an image's features replace;
    None: no image rows."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(slots=True)
class SeqState:
    """What the engine keeps per sequence between steps."""

    kv_tier: str
    act_tier: str
    sampling: SamplingParams
    pages: list[PageRef] = field(default_factory=list)
    """The page table, (tier, page id) per page, extended by each plan's new_pages."""
    has_sampled: bool = False
    """A token was sampled: every chunk from here on is a decode."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """echo + logprobs: the prompt positions scored so far (position 0 has none)."""
    pending_logprobs: torch.Tensor | None = None
    """(1, vocab) log-probabilities predicting the next prompt chunk's first token, on the
    compute device."""
    state: tuple[str, int] | None = None
    """A hybrid model's sequence: (tier, slot) of its state."""
    media: SeqMedia | None = None
    """Its prompt's images and M-RoPE positions (a vision model's); None: text."""
    image_features: list[torch.Tensor] = field(default_factory=list)
    """Each of `media`'s images' (num_tokens, hidden) features (`VisionEncoder`)."""

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.scores_prompt and not self.has_sampled


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
        image_rows = (stage(images.rows), images.features()) if images.rows else None
        device_group = self._stage_group(members[False], num_rows, self.device)
        cpu_group = self._stage_group(members[True], num_rows, torch.device("cpu"))
        tensor = self.inputs.tensor

        def make() -> GpuBatch:
            return GpuBatch(
                index=index,
                token_ids=tensor(staged_ids),
                positions=self.positions(
                    tensor(staged_positions).view(-1, 3) if self.mrope else tensor(staged_positions)
                ),
                logit_rows=tensor(staged_logits),
                logit_counts=logit_counts,
                device_group=device_group(),
                cpu_group=cpu_group(),
                new_kv={tier: make_rows() for tier, make_rows in kv.items()},
                act_rows={tier: tensor(rows) for tier, rows in acts.items()},
                num_padding=num_padding,
                states=StateRows(
                    spans,
                    {tier: (slots(), tensor(order)) for tier, (slots, order) in states.items()},
                    {tier: slot_runs(*slots_order) for tier, slots_order in state_slots.items()},
                )
                if spans
                else None,
                images=None if image_rows is None else (tensor(image_rows[0]), image_rows[1]),
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
    ) -> dict[int, RaggedLayout]:
        """One `RaggedLayout` per window of the model's layers."""
        return {
            w: RaggedLayout.build(q_lens, past_lens, where, w or None, seq_slots)
            for w in self.windows
        }

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
                    q_lens, past_lens, where, None if tables is None else tables()
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
