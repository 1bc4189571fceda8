"""Attention over ragged sequences: each has its own past length and number of new tokens.

Two ways in, both one SDPA call per group (decodes, prefill chunks) over padded (B, L)
tensors whose indices are precomputed once per step (`RaggedLayout`) and shared by every
layer, with no loop over sequences:
- `paged_attention`, where every key of the group lives in the compute device's KV pool
  (plain, uncompressed rows): the layer's new KV is written to its pages first, then one
  gather reads every key and value of the group from the pool, in place, straight into
  the padded layout (vLLM's write-then-attend). A decode's query needs no padding at all.
  On the CPU no group gathers: the native kernels (`engine.kernels`, decode and prefill)
  read each key where it lies in the pool; on CUDA one Triton kernel
  (engine/kernels/triton_paged.py) does, for decodes and prefill chunks alike (`PagedStep`).
- `ragged_attention`, the general path: past KV that the copy threads gathered from any
  tier (and decoded) arrives packed by sequence, and it and the new rows are scattered
  into the padded tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.kernels import PagedKernels
from engine.models.base import AttentionSpec
from engine.models.config import KVShape
from engine.storage.kv_store import select_rows

FULL = AttentionSpec()
"""Plain causal attention, scaled by head_dim ** -0.5."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One prefill chunk that attends alone (`PaddedGroup.chunks`): no padding of keys, and
    the kernel's own causal mask, which skips the keys a query cannot see, where the chunk
    has no past or a past shorter than itself (`lead`)."""

    row: int
    """Its first row among the group's new rows."""
    q_len: int
    kv_start: int
    """Its first key among the group's gathered slots."""
    kv_len: int
    window: int = 0
    """The sliding window; 0: none; negative: chunks of -window (`in_window`)."""
    spans: Spans = ()
    """Key ranges whose queries see each other both ways (`with_spans`)."""

    @property
    def lead(self) -> int:
        """Query rows put before the chunk's own so that SDPA's causal mask (key 0 for query
        0) lines up with its keys, when its past is shorter than itself and there is no
        window: (past + q)^2 / 2 products over those rows cost less than the q x (past + q)
        of a mask, which skips nothing; 0 where it needs a mask."""
        past = self.kv_len - self.q_len
        return past if past < self.q_len and not self.window and not self.spans else 0

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """(q_len, kv_len) bool visibility where the chunk needs one (a past as long as
        itself, a window, or spans seen both ways); None: SDPA's causal mask after `lead`
        rows."""
        past = self.kv_len - self.q_len
        if past < self.q_len and not self.window and not self.spans:
            return None
        q_pos = past + torch.arange(self.q_len, device=device)[:, None]
        k_pos = torch.arange(self.kv_len, device=device)[None, :]
        visible = with_spans(k_pos <= q_pos, k_pos, q_pos, self.spans)
        return visible & in_window(k_pos, q_pos, self.window) if self.window else visible


Spans = tuple[tuple[int, int], ...]
"""[start, stop) key ranges of one sequence (in its layout's key positions) whose queries see
each other both ways: Gemma 3's images."""


def with_spans(
    visible: torch.Tensor, k_pos: torch.Tensor, q_pos: torch.Tensor, spans: Spans
) -> torch.Tensor:
    """Causal `visible` (broadcast of `k_pos` against `q_pos`) widened so that a query inside a
    span sees every key of that span (transformers' `blockwise_overlay`, or'ed with the causal
    mask before the window's and)."""
    for start, stop in spans:
        inside = (q_pos >= start) & (q_pos < stop)
        visible = visible | (inside & (k_pos >= start) & (k_pos < stop))
    return visible


def in_window(k_pos: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Whether keys at `k_pos` lie within the window of queries at `q_pos` (broadcast; both
    absolute positions, causality apart): a sliding window (> 0) keeps the last `window`
    positions, itself included; chunked attention (< 0, Llama 4) keeps the query's own chunk
    of -window positions."""
    if window > 0:
        return k_pos > q_pos - window
    return k_pos >= q_pos - q_pos % -window


@dataclass(frozen=True, slots=True)
class PagedStep:
    """A group's sequences as one call of the one paged kernel (`PagedKernels.attention`),
    each key read through the slot table, nothing padded."""

    table: torch.Tensor
    """(B, W) int64 each sequence's key slots, past then new (a column past its length is
    never read)."""
    q_starts: torch.Tensor
    """(B + 1,) int64 where each sequence's rows begin among the group's new rows."""
    kv_lens: torch.Tensor
    """(B,) int64 each sequence's keys, past and new."""
    q_max: int
    kv_max: int
    window: int = 0
    """The sliding window; 0: none; negative: chunked attention (`in_window`)."""

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        past_lens: list[int],
        table: torch.Tensor,
        sliding_window: int | None,
    ) -> PagedStep:
        """The call's inputs: the offsets and lengths in one copy to the table's device."""
        kv_lens = [p + q for p, q in zip(past_lens, q_lens, strict=True)]
        starts = [0, *itertools.accumulate(q_lens)]
        both = torch.tensor([*starts, *kv_lens], dtype=torch.long, device=table.device)
        num_seqs = len(q_lens)
        return cls(
            table if table.stride(-1) == 1 else table.contiguous(),
            both[: num_seqs + 1],
            both[num_seqs + 1 :],
            max(q_lens),
            max(kv_lens),
            sliding_window or 0,
        )


@dataclass(slots=True)
class PaddedGroup:
    """Sequences of a layout padded together into one SDPA call over (B_g, heads, q_max,
    kv_max): the layout's decodes, or its prefill chunks."""

    num_seqs: int
    q_max: int
    kv_max: int
    new_rows: torch.Tensor | None
    """(T_g,) its rows among the layout's new rows; None: all of them."""
    past_rows: torch.Tensor | None
    """(P_g,) its rows of the layout's packed past; None: all of them."""
    q_dest: torch.Tensor
    """(T_g,) new row -> b * q_max + t."""
    new_dest: torch.Tensor
    """(T_g,) new k/v row -> b * kv_max + past_len_b + t."""
    past_dest: torch.Tensor
    """(P_g,) past k/v row -> b * kv_max + position."""
    mask: torch.Tensor | None
    """(B_g, 1, q_max, kv_max) bool: causal (and sliding-window) visibility; None when every
    query sees every key (decodes of one length, no window)."""
    slots: torch.Tensor | None = None
    """(B_g * kv_max,) the KV pool slot of every padded key position, past and new (a
    masked position repeats its sequence's first slot); with `chunks`, every sequence's
    slots back to back, unpadded; None: not read in place."""
    chunks: list[Chunk] | None = None
    """Prefill chunks read in place attend one at a time, each over its own keys only; None:
    the group is one padded call."""
    kv_lens: torch.Tensor | None = None
    """(B_g,) int64 keys per sequence, for a decode group read in place (the native kernel
    reads `slots` up to each length); None otherwise."""
    starts: tuple[torch.Tensor, torch.Tensor] | None = None
    """With `chunks`: (B_g + 1,) int64 where each sequence's rows begin among the group's new
    rows, and among `slots` (the native prefill kernel's offsets); None otherwise."""
    window: int = 0
    """The sliding window (a decode sees its last `window` keys); 0: none; negative: chunked
    attention (`in_window`)."""
    new_span: tuple[int, int] | None = None
    """[start, stop) when `new_rows` are one run of rows (a slice, not a gather)."""
    paged: PagedStep | None = None
    """The group as one call of the one paged kernel, where it reads its keys in place."""

    @property
    def num_past(self) -> int:
        return int(self.past_dest.shape[0])

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of a layout-wide (T, ...) tensor."""
        if self.new_span is not None:
            return x[self.new_span[0] : self.new_span[1]]
        assert self.new_rows is not None
        return x[self.new_rows]

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the group's rows into a layout-wide (T, ...) tensor."""
        if self.new_span is not None:
            out[self.new_span[0] : self.new_span[1]] = rows
        else:
            assert self.new_rows is not None
            out.index_copy_(0, self.new_rows, rows)


@dataclass(slots=True)
class RaggedLayout:
    """Where each row goes in the padded attention tensors of B sequences (T new rows in
    sequence order, P past rows packed in sequence order).

    Decodes and prefill chunks are padded apart: a step mixing one-token decodes with long
    prefill chunks would otherwise pad every decode to the longest chunk, B x q_max x kv_max
    work where the decodes need B x kv (the cost model charges the latter)."""

    groups: list[PaddedGroup]
    num_past: int
    """P: past rows over all groups."""

    @property
    def q_max(self) -> int:
        return max(g.q_max for g in self.groups)

    @property
    def in_place(self) -> bool:
        """Every group reads its keys from the KV pool in place (`paged_attention`)."""
        return all(g.slots is not None for g in self.groups)

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        past_lens: list[int],
        device: torch.device,
        sliding_window: int | None = None,
        seq_slots: torch.Tensor | list[list[int]] | None = None,
        spans: list[Spans] | None = None,
    ) -> RaggedLayout:
        """The layout of sequences with `q_lens` new tokens after `past_lens` past ones.
        `seq_slots`: per sequence, the KV pool slots of all its tokens, past and new, when
        its attention reads them in place (on `device`): a (B, W) table (`page_slots`; a
        row past its sequence's length is never read) or one list per sequence; None: it
        gets them packed. `spans`: per sequence, the key ranges its queries see both ways
        (their group is masked explicitly, not by a kernel's causal mask); None: none."""
        if isinstance(seq_slots, list):
            seq_slots = padded_table(seq_slots, device)
        decodes = [i for i, q in enumerate(q_lens) if q == 1]
        chunks = [i for i, q in enumerate(q_lens) if q > 1]
        members = [m for m in (decodes, chunks) if m]
        if len(members) == 1:
            group = _padded(q_lens, past_lens, device, sliding_window, None, None, seq_slots, spans)
            return cls([group], sum(past_lens))
        new_starts = [0, *itertools.accumulate(q_lens)]
        past_starts = [0, *itertools.accumulate(past_lens)]

        def rows(starts: list[int], seqs: list[int]) -> torch.Tensor:
            """Rows [starts[i], starts[i + 1]) of each sequence i of `seqs`, back to back."""
            counts = [starts[i + 1] - starts[i] for i in seqs]
            total = sum(counts)  # known on the host: no read of the device
            both = torch.tensor([*counts, *(starts[i] for i in seqs)], device=device)
            lens, firsts = both[: len(seqs)], both[len(seqs) :]
            shift = firsts - (torch.cumsum(lens, 0) - lens)
            return torch.repeat_interleave(shift, lens, output_size=total) + torch.arange(
                total, device=device
            )

        groups = []
        for seqs in members:
            group = _padded(
                [q_lens[i] for i in seqs],
                [past_lens[i] for i in seqs],
                device,
                sliding_window,
                rows(new_starts, seqs),
                rows(past_starts, seqs),
                None if seq_slots is None else seq_slots[torch.tensor(seqs, device=device)],
                None if spans is None else [spans[i] for i in seqs],
            )
            if seqs[-1] - seqs[0] + 1 == len(seqs):  # one run of sequences, so of rows
                group.new_span = (new_starts[seqs[0]], new_starts[seqs[-1] + 1])
            groups.append(group)
        return cls(groups, sum(past_lens))


def padded_rows(rows: list[list[int]]) -> tuple[list[int], int]:
    """B lists of ids, each padded with its last id to the longest (W), back to back:
    (B * W ids, W)."""
    width = max(map(len, rows))
    return [i for row in rows for i in row + row[-1:] * (width - len(row))], width


def padded_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(B, W) int64 of B lists of ids (`padded_rows`)."""
    flat, width = padded_rows(rows)
    return torch.tensor(flat, dtype=torch.long, device=device).view(len(rows), width)


def _padded(
    q_lens: list[int],
    past_lens: list[int],
    device: torch.device,
    sliding_window: int | None,
    new_rows: torch.Tensor | None,
    past_rows: torch.Tensor | None,
    seq_slots: torch.Tensor | None = None,
    spans: list[Spans] | None = None,
) -> PaddedGroup:
    """The padding indices and mask of one group of sequences; with `spans`, the mask and
    the chunks carry them and no paged kernel (causal only) runs the group."""
    if spans is not None and not any(spans):
        spans = None
    num_seqs, q_max = len(q_lens), max(q_lens)
    kv_max = max(p + q for p, q in zip(past_lens, q_lens, strict=True))
    q_len_t = torch.tensor(q_lens, device=device)
    past_t = torch.tensor(past_lens, device=device)
    seqs = torch.arange(num_seqs, device=device)

    def offsets(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence of each row, index of each row within its sequence)."""
        seq = torch.repeat_interleave(seqs, lens, output_size=total)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
        return seq, torch.arange(total, device=device) - starts

    seq_new, t_new = offsets(q_len_t, sum(q_lens))
    seq_past, pos_past = offsets(past_t, sum(past_lens))
    chunks = starts = None
    if seq_slots is not None and q_max > 1:
        chunks = _chunks(q_lens, past_lens, sliding_window, spans)
        kv_lens = [p + q for p, q in zip(past_lens, q_lens, strict=True)]
        starts = (_starts(q_lens, device), _starts(kv_lens, device))
    mask = None
    if chunks is None and (q_max > 1 or len(set(past_lens)) > 1 or sliding_window is not None):
        # Absolute position of query t of sequence b is past_len_b + t.
        q_pos = past_t[:, None] + torch.arange(q_max, device=device)[None, :]  # (B, q_max)
        k_pos = torch.arange(kv_max, device=device)[None, None, :]  # (1, 1, kv_max)
        visible = k_pos <= q_pos[:, :, None]  # causal; also hides padded keys
        for b, seq_spans in enumerate(spans or ()):
            visible[b] = with_spans(visible[b], k_pos[0], q_pos[b][:, None], seq_spans)
        if sliding_window is not None:
            visible &= in_window(k_pos, q_pos[:, :, None], sliding_window)
        q_valid = torch.arange(q_max, device=device)[None, :] < q_len_t[:, None]
        visible[:, :, 0] |= ~q_valid  # padded query rows attend somewhere: no all -inf row
        mask = visible[:, None]
    return PaddedGroup(
        num_seqs=num_seqs,
        q_max=q_max,
        kv_max=kv_max,
        new_rows=new_rows,
        past_rows=past_rows,
        q_dest=seq_new * q_max + t_new,
        new_dest=seq_new * kv_max + past_t[seq_new] + t_new,
        past_dest=seq_past * kv_max + pos_past,
        mask=mask,
        slots=None
        if seq_slots is None
        else _padded_slots(seq_slots, past_t + q_len_t, kv_max, chunks),
        chunks=chunks,
        kv_lens=past_t + q_len_t if seq_slots is not None and q_max == 1 else None,
        starts=None if spans else starts,
        window=sliding_window or 0,
        paged=None
        if seq_slots is None or spans
        else PagedStep.build(q_lens, past_lens, seq_slots, sliding_window),
    )


def _starts(lens: list[int], device: torch.device) -> torch.Tensor:
    """(B + 1,) int64: 0, then the running sums of `lens`."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long, device=device)


def _chunks(
    q_lens: list[int],
    past_lens: list[int],
    sliding_window: int | None,
    spans: list[Spans] | None = None,
) -> list[Chunk]:
    """Each sequence as a `Chunk`, its keys right after the previous one's."""
    out, row, kv_start = [], 0, 0
    for b, (q_len, past_len) in enumerate(zip(q_lens, past_lens, strict=True)):
        kv_len = past_len + q_len
        seq_spans = () if spans is None else spans[b]
        out.append(Chunk(row, q_len, kv_start, kv_len, sliding_window or 0, seq_spans))
        row, kv_start = row + q_len, kv_start + kv_len
    return out


def _padded_slots(
    seq_slots: torch.Tensor, kv_lens: torch.Tensor, kv_max: int, chunks: list[Chunk] | None
) -> torch.Tensor:
    """(B * kv_max,) each sequence's slots, padded with its first slot (always masked); for
    chunks attending alone, not padded."""
    table = seq_slots[:, :kv_max]
    live = torch.arange(kv_max, device=table.device)[None, :] < kv_lens[:, None]
    if chunks is not None:
        return table[live]  # row-major: sequence after sequence
    return torch.where(live, table, table[:, :1]).reshape(-1)


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor | None,
    past_v: torch.Tensor | None,
    layout: RaggedLayout,
    spec: AttentionSpec = FULL,
) -> torch.Tensor:
    """Causal attention of the new rows over each sequence's past and new keys, one padded
    SDPA call per group of the layout (whose mask carries the layer's window), scored as
    `spec` says.

    q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim) for the new tokens;
    past_k, past_v: (P, num_kv_heads, head_dim) packed in sequence order (None if P = 0).
    Returns (T, num_heads, head_dim).
    """
    if len(layout.groups) == 1:
        return _padded_attention(q, k, v, past_k, past_v, layout.groups[0], spec)
    out = torch.empty_like(q)
    for g in layout.groups:
        assert g.past_rows is not None
        pk = pv = None
        if past_k is not None and past_v is not None and g.num_past:
            pk, pv = past_k.index_select(0, g.past_rows), past_v.index_select(0, g.past_rows)
        o = _padded_attention(g.take(q), g.take(k), g.take(v), pk, pv, g, spec)
        g.put(out, o)
    return out


def _padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor | None,
    past_v: torch.Tensor | None,
    g: PaddedGroup,
    spec: AttentionSpec,
) -> torch.Tensor:
    """One group's rows scattered into padded tensors, one SDPA call, gathered back."""
    b, q_max, kv_max = g.num_seqs, g.q_max, g.kv_max
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]

    def padded_kv(new: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
        out = new.new_zeros(b * kv_max, num_kv_heads, head_dim)
        out.index_copy_(0, g.new_dest, new)
        if past is not None and g.num_past:
            out.index_copy_(0, g.past_dest, past)
        return out.view(b, kv_max, num_kv_heads, head_dim).transpose(1, 2)  # (B, kvh, L, hd)

    qp = q.new_zeros(b * q_max, num_heads, head_dim)
    qp.index_copy_(0, g.q_dest, q)
    qp = qp.view(b, q_max, num_heads, head_dim).transpose(1, 2)  # (B, nh, Qm, hd)
    out = sdpa(
        qp, padded_kv(k, past_k), padded_kv(v, past_v), g.mask, False, spec
    )  # (B, nh, Qm, hd)
    return out.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)[g.q_dest]


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    decode: Callable[[torch.Tensor], torch.Tensor],
    layout: RaggedLayout,
    kv_shape: KVShape,
    kernels: PagedKernels | None = None,
    spec: AttentionSpec = FULL,
) -> torch.Tensor:
    """Causal attention of the new rows over every key of their sequences, read in place from
    one layer's KV pool (its new keys already written there), scored as `spec` says (the
    layout's mask and `window` carry the layer's window).

    q: (T, num_heads, head_dim); pool: (slots, row_bytes) encoded rows; `decode` turns
    gathered rows into (N, kv_shape.row_dim) KV rows, keys then values or, where
    `kv_shape.values_are_keys`, keys read as the values too (a view for plain rows, and so of
    the whole pool). `kernels`: the native CPU kernels or Triton's (`engine.kernels`), which
    read the pool as it lies instead of gathering a copy (the row's width tells them where
    its values are), one call per group (decodes, prefill chunks): on CUDA the one paged
    kernel for both (`PagedKernels.attention`), each with its own tiles.
    Returns (T, num_heads, head_dim)."""
    if len(layout.groups) == 1:
        return _paged_group(q, pool, decode, layout.groups[0], kv_shape, kernels, spec)
    out = torch.empty_like(q)
    for g in layout.groups:
        g.put(out, _paged_group(g.take(q), pool, decode, g, kv_shape, kernels, spec))
    return out


def _paged_group(
    q: torch.Tensor,
    pool: torch.Tensor,
    decode: Callable[[torch.Tensor], torch.Tensor],
    g: PaddedGroup,
    kv_shape: KVShape,
    kernels: PagedKernels | None,
    spec: AttentionSpec,
) -> torch.Tensor:
    """One group: the one paged kernel or a native kernel over the pool (when given them;
    they do not soft-cap), or one gather from the pool and SDPA. A decode group uses q as it
    is, without a padded copy. Sinks reach the kernels as they lie, on the compute device (in
    float32)."""
    assert g.slots is not None
    b, q_max, kv_max = g.num_seqs, g.q_max, g.kv_max
    num_heads, head_dim = q.shape[1], q.shape[2]
    native = kernels is not None and not spec.softcap
    one, step = None if kernels is None else kernels.attention, g.paged
    if native and one is not None and step is not None:
        q, scale, sinks = _kernel_inputs(q, spec)
        return one(
            q, decode(pool), step.table, step.q_starts, step.kv_lens, kv_shape[0], scale,
            step.window, step.q_max, step.kv_max, sinks,
        )  # fmt: skip
    prefill = None if kernels is None else kernels.prefill
    if native and (g.kv_lens is not None or (g.starts is not None and prefill is not None)):
        assert kernels is not None
        rows = decode(pool)  # plain rows: a view of the whole pool
        q, scale, sinks = _kernel_inputs(q, spec)
        if g.kv_lens is not None:
            return kernels.decode(
                q, rows, g.slots, g.kv_lens, kv_shape[0], scale, g.window, sinks=sinks
            )
        assert g.starts is not None and prefill is not None
        q_starts, kv_starts = g.starts
        return prefill(
            q, rows, g.slots, q_starts, kv_starts, kv_shape[0], scale, g.window, sinks=sinks
        )
    # a row's sides: keys then values (2), or the keys alone, read as the values too (1)
    sides, heads_dim = 1 if kv_shape.values_are_keys else 2, kv_shape[:2]
    if g.chunks is not None:
        keys = decode(select_rows(pool, g.slots)).view(-1, sides, *heads_dim)  # (sum L, 2, ...)
        outs = []
        for c in g.chunks:
            kc = keys[c.kv_start : c.kv_start + c.kv_len].transpose(0, 2)  # (kvh, 2, L, hd)
            qc = q[c.row : c.row + c.q_len]
            if c.lead:
                qc = torch.cat([qc.new_zeros(c.lead, *qc.shape[1:]), qc])
            mask = c.mask(q.device)
            out = sdpa(
                qc.transpose(0, 1)[None],  # (1, nh, lead + t, hd)
                kc[None, :, 0],
                kc[None, :, -1],
                mask,
                mask is None,
                spec,
            )
            outs.append(out[0, :, c.lead :].transpose(0, 1))
        return torch.cat(outs)
    kv = decode(select_rows(pool, g.slots)).view(b, kv_max, sides, *heads_dim)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, -1].transpose(1, 2)  # (B, kvh, L, hd) views
    if q_max == 1:
        qp = q.view(b, 1, num_heads, head_dim).transpose(1, 2)  # (B, nh, 1, hd), no copy
    else:
        qp = q.new_zeros(b * q_max, num_heads, head_dim)
        qp.index_copy_(0, g.q_dest, q)
        qp = qp.view(b, q_max, num_heads, head_dim).transpose(1, 2)  # (B, nh, Qm, hd)
    out = sdpa(qp, k, v, g.mask, False, spec)  # (B, nh, Qm, hd)
    out = out.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)
    return out if q_max == 1 else out[g.q_dest]


def _kernel_inputs(
    q: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """(q with its heads adjacent, the scale, the sinks as they lie on the compute device in
    float32) for the paged kernels, which take rows strided and heads adjacent."""
    head_dim = q.shape[2]
    if q.stride()[1:] != (head_dim, 1):
        q = q.contiguous()
    scale = head_dim**-0.5 if spec.scale is None else spec.scale
    return q, scale, None if spec.sinks is None else spec.sinks.float().contiguous()


def join_kv(k: torch.Tensor, v: torch.Tensor, values_are_keys: bool = False) -> torch.Tensor:
    """k and v, each (T, num_kv_heads, head_dim), as (T, 2 * kv_dim) KV rows: a view where v
    lies right after k in each row of one tensor (the model's rotary passes values through
    beside the keys), else a copy. `values_are_keys` (v is k: `KVShape`): the (T, kv_dim)
    keys alone, a view."""
    rows, kv_dim = k.shape[0], k.shape[1] * k.shape[2]
    if values_are_keys:
        assert v is k, "a model whose values are its keys returns the same tensor for both"
        return k.reshape(rows, kv_dim)
    adjacent = (
        k.stride() == v.stride()
        and k.stride()[1:] == (k.shape[2], 1)
        and v.data_ptr() == k.data_ptr() + kv_dim * k.element_size()
        and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    )
    if adjacent and rows:
        return k.as_strided((rows, 2 * kv_dim), (k.stride(0), 1))
    return torch.cat([k.reshape(rows, kv_dim), v.reshape(rows, kv_dim)], dim=1)


def split_kv(
    rows: torch.Tensor | None, kv_shape: KVShape
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(N, kv_shape.row_dim) packed KV rows -> k and v, each (N, num_kv_heads, head_dim); where
    the values are the keys, both are the same view of the rows."""
    if rows is None:
        return None, None
    n, kv_dim, heads_dim = rows.shape[0], kv_shape.kv_dim, kv_shape[:2]
    k = rows[:, :kv_dim].reshape(n, *heads_dim)
    return k, k if kv_shape.values_are_keys else rows[:, kv_dim:].reshape(n, *heads_dim)


class HostSinks:
    """Each layer's sink logits (gpt-oss) in host memory, for the attention that runs on the
    CPU while the layer's weights lie on a GPU: copied there once per layer, the first time
    (the sinks are weights: they never change), not once per step, where the copy would make
    the layer loop wait on the device."""

    def __init__(self) -> None:
        self._by_layer: dict[int, torch.Tensor] = {}

    def spec(self, j: int, spec: AttentionSpec) -> AttentionSpec:
        """`spec` with layer j's sinks in host memory."""
        if spec.sinks is None or spec.sinks.device.type == "cpu":
            return spec
        host = self._by_layer.get(j)
        if host is None:
            host = self._by_layer[j] = spec.sinks.to("cpu", torch.float32)
        return replace(spec, sinks=host)


def cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: torch.Tensor | None,
    layout: RaggedLayout,
    kv_shape: KVShape,
    spec: AttentionSpec = FULL,
) -> torch.Tensor:
    """Decode attention on the CPU over host-homed past KV (FlexGen Sec. 4.2): (T, heads,
    head_dim) float32 on the CPU. Computes in float32 (CPU half matmuls are slow and less
    exact); q, k, v may live anywhere and are copied as needed (where the values are the
    keys, once)."""
    k_host = k.to("cpu", torch.float32)
    v_host = k_host if kv_shape.values_are_keys else v.to("cpu", torch.float32)
    return ragged_attention(
        q.to("cpu", torch.float32), k_host, v_host, *split_kv(past, kv_shape), layout, spec
    )


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    spec: AttentionSpec,
) -> torch.Tensor:
    """SDPA over q (B, nh, Q, hd) and k, v (B, kvh, L, hd) with `spec`'s scale; with a
    soft-cap or sinks (which SDPA cannot apply), the same product in plain ops, as
    transformers' eager attention computes it: scores scaled, capped, masked, softmax in
    float32; with sinks, gpt-oss's: each head's sink logit one more column, every row less
    its maximum, the softmax in the scores' dtype, the sink's column dropped."""
    if not spec.softcap and spec.sinks is None:
        gqa = q.shape[1] != k.shape[1]
        return scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=spec.scale, enable_gqa=gqa
        )
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head h reads kv head h // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, nh, Q, L)
    if spec.softcap:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if is_causal:  # query i sees keys 0..i (SDPA's top-left causal mask)
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    b, nh, q_len, _ = scores.shape
    sinks = spec.sinks.to(scores.device, scores.dtype).view(1, nh, 1, 1).expand(b, nh, q_len, 1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
