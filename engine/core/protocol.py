"""The records that cross the scheduler/executor boundary (torch-free).

`StepPlan` and `StepResult` per step; `EngineInfo` (with its `Placement`) once, when the
executor is built. All are plain picklable dataclasses: they cross a process pipe.

One engine step runs every scheduled chunk through all layers (zig-zag over the
block's GPU batches) and samples one token for each chunk that asks for one.
Plans carry what changed: new tokens, new KV pages, sampling settings the
first time a sequence is seen, and the ids of sequences to forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_pages import PageCopy, PageMove
from engine.core.media import SeqMedia
from engine.core.prefix_cache import PageRef
from engine.core.sampling_params import SamplingParams

PENDING_TOKEN_ID = -1
"""Stands in a decode chunk for the token this sequence sampled in the previous step,
not yet known when the plan was built (asynchronous scheduling). The driver
replaces it with `StepPlan.fill_pending_tokens` before the plan runs."""


@dataclass(slots=True)
class SeqChunk:
    """The tokens one sequence feeds into one step."""

    seq_id: int
    token_ids: list[int]
    """Tokens to run: a prompt chunk (prefill) or the last sampled token (decode)."""
    start_pos: int
    """Position of token_ids[0]; equals the number of tokens already in this sequence's KV."""
    gpu_batch: int
    """Which GPU batch of the block this sequence computes in."""
    new_pages: list[PageRef]
    """(tier, page id) of the KV pages appended to this sequence's page table for these
    tokens (may be empty). Its own pages are on its home tier; pages of a cached prefix
    (first chunk only) may be on any tier and are only read."""
    kv_tier: str
    """Home tier of this sequence's own KV pages: 'gpu', 'cpu' or 'disk'."""
    act_tier: str
    """Tier that homes this sequence's activations between layers."""
    do_sample: bool
    """Sample a token after this chunk (decode, or the last chunk of a prompt)."""
    sampling: SamplingParams | None = None
    """Sent with the first chunk of a sequence; the engine keeps it until the sequence is freed."""
    media: SeqMedia | None = None
    """The prompt's images and M-RoPE positions, sent and kept as `sampling` is; None: text."""
    state_slot: tuple[str, int] | None = None
    """A hybrid model's sequence: (tier, slot) of its state (engine/core/state_slots.py), the
    same in every chunk until it is freed; the first chunk of a sequence starts it at zero,
    or from `state_restore`."""
    state_restore: tuple[str, int] | None = None
    """With the first chunk of a hybrid's sequence that hit the prefix cache: the snapshot
    slot (engine/core/state_slots.py, `StateSnapshots`) holding the state at the end of its
    cached prefix (`start_pos` tokens), copied into `state_slot` before the step runs."""
    state_save: tuple[str, int] | None = None
    """A hybrid's chunk that ends where a prefix's state is to be kept: the snapshot slot its
    state is copied into once the step has run."""
    num_sampled: int = 0
    """Tokens this sequence has already generated (keys the per-request seeded RNG)."""
    cached_token_ids: list[int] = field(default_factory=list)
    """With the first chunk, for settings that read the sequence's tokens (penalties,
    structured outputs: `SamplingParams.needs_history`): its tokens before `start_pos`,
    whose KV came from the prefix cache."""
    forked_from: int | None = None
    """A fork: another choice of the prompt that sequence `forked_from` computes in this step
    (n > 1). It runs no tokens (`token_ids` is empty, `start_pos` the prompt's length): it
    takes `new_pages`, the prompt's pages it now shares, and samples its first token from the
    same logits row as `forked_from`, with its own settings and seed."""


@dataclass(slots=True)
class StepPlan:
    """Everything the engine needs for one step."""

    step_id: int
    chunks: list[SeqChunk]
    freed_seq_ids: list[int] = field(default_factory=list)
    """Sequences finished, aborted or preempted since the last plan: drop their engine state.
    Apply before running the chunks: their pages may already be reused in this plan."""
    cached_disk_pages: list[tuple[int, str]] = field(default_factory=list)
    """(disk page id, hash) of disk pages that became cached since the last plan (the
    executor records them in the persistent disk-cache index)."""
    page_moves: list[PageMove] = field(default_factory=list)
    """Cached pages to copy between tiers, in order, before this step reads or writes any
    KV (a spill down, a load back up for a hit); the source page is free afterwards."""
    page_copies: list[PageCopy] = field(default_factory=list)
    """Copy-on-write of shared partial pages, in order, after `page_moves` and before the
    step reads or writes any KV: each copy's `dst` replaces `src` in its sequence's table."""
    disk_hits: list[tuple[int, str]] = field(default_factory=list)
    """(disk page id, hash) of cached disk pages a sequence starts to read in place in this
    step: the executor verifies them (and the disk sources of `page_moves`) first."""
    dense_size: int = 0
    """Token rows this step runs (NanoFlow's discrete batch size): num_tokens plus padding
    rows that go through the dense ops only; 0 means num_tokens."""

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    def fill_pending_tokens(self, previous: StepResult) -> None:
        """Replace each PENDING_TOKEN_ID with the token `previous` sampled for that sequence."""
        sampled = dict(zip(previous.seq_ids, previous.token_ids, strict=True))
        for chunk in self.chunks:
            if chunk.token_ids and chunk.token_ids[-1] == PENDING_TOKEN_ID:
                chunk.token_ids[-1] = sampled[chunk.seq_id]

    @property
    def has_pending_tokens(self) -> bool:
        return any(c.token_ids and c.token_ids[-1] == PENDING_TOKEN_ID for c in self.chunks)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the chosen token and of the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class StepFailure:
    """Why the executor could not run a plan: its offload storage failed (a full disk, an I/O
    error), or a cached page failed verification. Nothing of the plan counts: the scheduler
    recomputes its sequences (`Scheduler.recover`)."""

    message: str
    """One line: what failed ("writing kv-0003.bin in /offload failed: No space left on
    device")."""
    tier: str | None = None
    """The tier whose storage failed ('disk'); None when only cached pages failed their check."""
    seq_ids: list[int] = field(default_factory=list)
    """Sequences of the plan that used the failed tier (their KV, activations or weights)."""
    bad_pages: list[int] = field(default_factory=list)
    """Disk pages whose cached contents cannot be trusted: unreadable, or failing their check
    (the scheduler drops them from the prefix cache)."""


@dataclass(slots=True)
class StepResult:
    """What one step produced: a token per sampled chunk, in plan order; a pooled output in
    place of the token for a pooling request's last chunk (`pooled`)."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """For sequences whose sampling asked for echo + logprobs: logprobs of the prompt tokens."""
    bytes_per_tier: dict[str, int] = field(default_factory=dict)
    """Bytes resident per tier after the step (weights, KV pools, activations), as they grow:
    what /metrics reports; empty when the executor does not say."""
    errors: dict[int, str] = field(default_factory=dict)
    """Sequences whose sampling failed in this step (a token id outside the vocabulary, a
    grammar error): they finish with this message; the rest of the step stands."""
    failure: StepFailure | None = None
    """The step did not run (or not to its end): no tokens, see `StepFailure`."""
    pooled: dict[int, list[float]] = field(default_factory=dict)
    """Pooling requests whose prompt ended in this step (`SamplingParams.pooling`): sequence
    id -> its pooled output (engine/executor/pooler.py); they are not in `seq_ids`."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the executor put things: realized bytes per tier next to what the policy planned."""

    planned_weights_frac: tuple[float, float, float]
    """The policy's weights_frac (gpu, cpu, disk)."""
    realized_weights_frac: tuple[float, float, float]
    """Share of weight bytes actually homed per tier (layers are placed whole)."""
    weights_bytes: dict[str, int]
    kv_bytes: dict[str, int]
    """KV pool bytes reserved per tier so far."""
    act_bytes: dict[str, int]
    """Peak bytes of between-layer activations homed per tier so far."""
    weight_tiers: tuple[str, ...]
    """Home tier of each layer (embedding, decoder layers, head)."""
    device: str
    """The compute device, e.g. 'cpu' or 'cuda:0'."""
    dtype: str
    """The compute dtype, e.g. 'float32'."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """A hybrid model's per-sequence state slots, bytes per tier (allocated at start)."""

    def bytes_per_tier(self) -> dict[str, int]:
        """Weights, KV, states and activations together, per tier."""
        out: dict[str, int] = {}
        for part in (self.weights_bytes, self.kv_bytes, self.state_bytes, self.act_bytes):
            for tier, nbytes in part.items():
                out[tier] = out.get(tier, 0) + nbytes
        return out


@dataclass(frozen=True, slots=True)
class WarmUp:
    """The engine's warm-up at start (engine/executor/warm_up.py): every CUDA graph a decode
    step can replay captured, every Triton specialization a step can meet compiled."""

    seconds: float
    """Wall time of the warm-up: part of the start-up, before the engine says it is ready."""
    graphs_captured: int
    """CUDA graphs captured (two a decoder layer, one embedding, per row count)."""
    kernels_compiled: int
    """Triton specializations compiled (on a GPU) or met (the rehearsal)."""
    num_steps: int
    """Steps run on dummy sequences to meet the kernels' specializations."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a scheduler (in this process or the daemon) needs from a freshly built executor."""

    page_tokens: int
    """Tokens per KV page."""
    kv_capacity_pages: dict[str, int | None]
    """KV pages each tier may hold (None: bounded only by the machine)."""
    placement: Placement
    """The realized placement when the executor was built."""
    page_bytes: int = 0
    """Bytes of one KV page, every layer, as stored (compressed or not)."""
    cache_salt: str = ""
    """What besides the tokens determines a page's KV bytes (model, dtype, compression,
    page size), hashed: mixed into every prefix-cache page hash."""
    disk_cache: list[tuple[str, int]] = field(default_factory=list)
    """(hash, disk page id) of the cached pages a previous run left on disk, verified."""
    scratch_dir: str | None = None
    """A temporary directory the executor made (the disk tier without --offload-dir): it
    removes it when closed; whoever outlives a killed executor removes it instead."""
    budgets: dict[str, int] = field(default_factory=dict)
    """The byte budget of each tier the executor ran under (given, or derived from the
    machine): a restarted executor gets the same ones."""
    disk_cache_dropped: int = 0
    """Entries of the previous run's disk-cache index dropped at start (damaged, not ours)."""
    warnings: list[str] = field(default_factory=list)
    """Lines for the log: what went wrong while building, without stopping it."""
    state_slots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's per-sequence state slots per tier; empty: no state layers."""
    state_bytes: int = 0
    """Bytes of one sequence's state, every state layer (0: no state layers)."""
    state_snapshots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's snapshot slots for the prefix cache of states: {tier: count}, after
    that tier's running slots (empty: its prefix caching is off)."""
    warm_up: WarmUp | None = None
    """What the engine made ready before its first step (CUDA graphs, Triton kernels) and
    how long it took; None: no warm-up ran (`--no-warmup`, or the CPU)."""
