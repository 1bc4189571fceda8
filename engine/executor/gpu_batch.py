"""`GpuBatch`: one GPU batch of a step as flat token rows, with every index its layers need.

Built once per step (`BatchBuilder`, engine/executor/batch_builder.py); every layer of the
step reuses it, so no layer loops over sequences in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.core.media import SeqMedia
from engine.core.prefix_cache import PageRef
from engine.core.protocol import TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.executor.attention import RaggedLayout
from engine.models.base import Positions
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
class PastKV:
    """The past KV a (layer, GPU batch) attends over, per attention group, packed by sequence."""

    device: torch.Tensor | None
    """(P, row_dim) on the compute device for the device group; None if no past."""
    cpu: torch.Tensor | None
    """(P_cpu, row_dim) float32 in host memory for the CPU-attention group; None if none."""


NO_PAST = PastKV(None, None)


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
class TokenRows:
    """What enters a GPU batch's layers, row by row (T rows)."""

    ids: torch.Tensor
    """(T,) token ids on the compute device."""
    positions: Positions
    """(T,) absolute positions on the compute device, with the model's tables for them."""
    num_padding: int = 0
    """Rows after the chunks' rows that only pad the dense ops to the step's discrete size."""
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows (R,), features (R, hidden)): rows whose embedding an image's features replace;
    None: no image rows."""


@dataclass(slots=True)
class RowHomes:
    """Where a GPU batch's rows keep what outlives a layer: their new KV, their activations
    between layers, a hybrid model's states."""

    new_kv: dict[str, KVRows]
    """Per tier: the slots for the new tokens' KV and their rows in the batch."""
    act_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """tier -> (rows,) indices of rows homed there; empty when every row stays on the gpu tier."""
    states: StateRows | None = None
    """A hybrid model's: each sequence's rows and state slot; None: no state layers. State
    layers run the batch whole, nano-batches or not: each row reads and writes only its own
    sequence's state."""


@dataclass(slots=True)
class GpuBatch:
    """Everything a layer needs to run one GPU batch (T = new tokens, S = sampled rows)."""

    index: int
    tokens: TokenRows
    logit_rows: torch.Tensor
    """(S,) rows whose next-token logits the head computes."""
    logit_counts: list[int]
    """Per chunk, in order: how many of the logit rows are its (its last row when it samples,
    every row when its prompt logprobs are wanted, none otherwise)."""
    device_group: AttentionGroup | None
    """Sequences attending on the compute device."""
    cpu_group: AttentionGroup | None
    """Decodes over cpu- or disk-homed KV attending on the CPU (FlexGen Sec. 4.2)."""
    homes: RowHomes
    nano_batches: list[NanoBatch] = field(default_factory=list)
    """Its nano-batches (cut by engine/executor/nano_batches.py); empty: its layers run it whole."""

    @property
    def token_ids(self) -> torch.Tensor:
        return self.tokens.ids

    @property
    def positions(self) -> Positions:
        return self.tokens.positions

    @property
    def num_padding(self) -> int:
        return self.tokens.num_padding

    @property
    def images(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.tokens.images

    @property
    def new_kv(self) -> dict[str, KVRows]:
        return self.homes.new_kv

    @property
    def act_rows(self) -> dict[str, torch.Tensor]:
        return self.homes.act_rows

    @property
    def states(self) -> StateRows | None:
        return self.homes.states

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def reads_kv_in_place(self) -> bool:
        """The device group reads its KV in place from the gpu tier's pool (a nano-batched
        one reads it packed: each nano-batch slices its sequences' rows)."""
        dev = self.device_group
        return dev is not None and dev.layout.in_place and not self.nano_batches


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
