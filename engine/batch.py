"""`Batch`: one GPU batch of a step as flat token rows, with where each sequence lives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SeqSlice:
    """One sequence's share of a batch."""

    seq_id: int
    row_start: int
    """First of this sequence's q_len rows in the batch's (T, hidden) states."""
    q_len: int
    ctx_len: int
    """Tokens already in the KV cache before this step."""
    kv_tier: str
    act_tier: str
    cpu_attention: bool
    """Decode attention runs on the CPU over CPU-homed KV (FlexGen Sec. 4.2)."""
    past_slots: list[int]
    """KV pool slots of tokens [0, ctx_len)."""
    new_slots: list[int]
    """KV pool slots for the q_len new tokens."""

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.q_len)


@dataclass(slots=True)
class Batch:
    """Everything a layer needs to run one GPU batch (T = total new tokens, S = sampled rows)."""

    index: int
    seqs: list[SeqSlice]
    token_ids: torch.Tensor
    """(T,) on the compute device."""
    positions: torch.Tensor
    """(T,) absolute positions on the compute device."""
    logit_rows: torch.Tensor
    """(S,) rows whose next-token logits the head computes."""
    act_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """tier -> (rows,) indices of rows homed there; empty when every row stays on the gpu tier."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
