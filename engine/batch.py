"""`Batch`: one GPU batch of a step as flat token rows, with every index its layers need.

Built once per step by the executor; every layer of the step reuses it, so no
layer loops over sequences in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import RaggedLayout


@dataclass(slots=True)
class KVRows:
    """Token rows of one tier's KV pool that a batch reads or writes, and where they go."""

    slots: list[int]
    """Pool slots (the disk tier reads and writes coalesced runs of them)."""
    slot_index: torch.Tensor | None
    """The same slots on the pool's device, for the memory tiers (None for disk)."""
    rows: torch.Tensor
    """On the compute device: each slot's row in the packed order it is gathered into
    (past KV packed in sequence order) or taken from (the batch's new-token rows)."""


@dataclass(slots=True)
class AttentionGroup:
    """The sequences of a batch whose attention runs on one device."""

    rows: torch.Tensor | None
    """(T_g,) batch rows of the group's new tokens on the compute device; None: every row."""
    layout: RaggedLayout
    """Padding indices and mask, on the device the group's attention runs on."""
    past: dict[str, KVRows]
    """Per tier: the slots of the group's past tokens and their rows in its packed past."""


@dataclass(slots=True)
class Batch:
    """Everything a layer needs to run one GPU batch (T = new tokens, S = sampled rows)."""

    index: int
    token_ids: torch.Tensor
    """(T,) on the compute device."""
    positions: torch.Tensor
    """(T,) absolute positions on the compute device."""
    logit_rows: torch.Tensor
    """(S,) rows whose next-token logits the head computes."""
    device_group: AttentionGroup | None
    """Sequences attending on the compute device."""
    cpu_group: AttentionGroup | None
    """Decodes over cpu-homed KV attending on the CPU (FlexGen Sec. 4.2)."""
    new_kv: dict[str, KVRows]
    """Per tier: the slots for the new tokens' KV and their rows in the batch."""
    act_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """tier -> (rows,) indices of rows homed there; empty when every row stays on the gpu tier."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
