"""`SchedulerConfig`: how the scheduler forms steps, and the discrete batch sizes it pads to.

Torch-free. The dense batch sizes (NanoFlow 4.2) are fixed here so that the executor's
warm-up captures the same shapes the scheduler runs (`discrete_sizes`, `pick_size`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from base.errors import UserError
from policy import TIERS, Policy
from policy.policy import Triple


class SchedulerConfigError(UserError, ValueError):
    """Scheduler settings that cannot work together (say which flag to change)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler forms steps; build with `from_policy` or by keyword."""

    gpu_batch_size: int = 8
    """Sequences per GPU batch; gpu_batch = slot // gpu_batch_size."""
    num_gpu_batches: int = 1
    """GPU batches per block; block_size = gpu_batch_size * num_gpu_batches."""
    kv_frac: Triple = (1.0, 0.0, 0.0)
    """Target share of sequences whose KV is homed on gpu / cpu / disk."""
    act_frac: Triple = (1.0, 0.0, 0.0)
    """Target share of sequences whose activations are homed on gpu / cpu / disk."""
    page_tokens: int = 16
    """Tokens per KV page."""
    kv_capacity_pages: dict[str, int | None] = field(default_factory=dict)
    """KV pages available per tier; a missing tier or None is unbounded."""
    state_slots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's per-sequence state slots per tier (engine/core/state_slots.py): a
    sequence is admitted only with a free one on its state tier; empty: no state layers."""
    state_snapshots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's snapshot slots for the states of cached prefixes (`StateSnapshots`):
    {tier: count}, numbered after that tier's `state_slots`; none turns its prefix caching
    off."""
    max_step_tokens: int = 2048
    """Most tokens (decodes plus prefill chunks) in one step."""
    batch_sizes: tuple[int, ...] = ()
    """The discrete dense batch sizes a step runs (NanoFlow 4.2), ascending; empty:
    `discrete_sizes(max_step_tokens, None, block_size)`."""
    discrete_batching: bool = True
    """Fill each step to one of batch_sizes and pad the rest (fixed shapes: CUDA graphs,
    tuned kernels); False runs exactly the scheduled tokens, budgeted by max_step_tokens."""
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2048
    """Context window: prompt plus generated tokens."""
    expected_gen_tokens: int | None = None
    """Generated length KV admission assumes per request (capped by its max_tokens): a fixed
    number, or None for NanoFlow's estimate (4.4), the running mean output length of the
    finished requests (max_tokens until one has finished). A wrong estimate is caught by
    preemption, never by running out of pages."""
    conservative_admission: bool = False
    """Assume every request runs to max_tokens: nothing is ever preempted, but fewer
    sequences run at once when most stop early."""
    enable_prefix_caching: bool = False
    """Keep finished sequences' full KV pages cached (spilling LRU pages down the tiers) and
    let new requests reuse the longest cached prefix instead of recomputing it."""
    cache_salt: str = ""
    """Mixed into every page hash: what else determines the KV bytes (EngineInfo.cache_salt)."""
    max_cached_pages: dict[str, int] = field(default_factory=dict)
    """Per tier, the most cached pages nobody holds (the disk cache's size bound)."""
    min_hit_tokens: dict[str, int] = field(default_factory=dict)
    """Per tier, the shortest cached prefix worth loading from there instead of recomputing
    (the cost model's break-even); a shorter hit on that tier is recomputed."""
    static_blocks: bool = False
    """FlexGen-style baseline: admit only into an empty block, so a block runs to completion
    before the next starts (no refill). False: continuous refill after every step."""
    offload_retry_s: float = 2.0
    """After a tier's storage failed in a step (a full disk, an I/O error), how long it takes
    no new KV (no sequence homed there, no spill, no hit read there); then it is tried again."""
    prefix_ordering: bool = True
    """With prefix caching: batch work waits in the trie order of its prompts' page hashes, so
    lines that share a prefix run back to back while it is cached, and a prompt whose next
    uncached page a running sequence is computing waits a step to hit it (`PrefixQueue`,
    `PrefixGate`). False: FIFO, and shared pages computed at once are computed twice."""
    batch_share: float = 0.25
    """While online requests wait or run, the most batch work takes: this share of the block's
    slots (rounded up) for its lines, and as many prefill tokens a step (so an online
    request's steps run about a full block's decodes, not the step's whole budget). New batch
    lines wait; an online request short of a slot takes the newest batch line's (preempted,
    its tokens kept: it recomputes its KV later). 1.0: priority alone."""
    batch_step_cap: bool = False
    """In every step, online work present or not, batch prefill takes at most batch_share of
    max_step_tokens (rounded up): the step an online request arrives during and the step
    planned ahead of it (asynchronous scheduling) are never a full budget of batch prefill,
    so its wait is bounded by two short steps; for 2 steps after online work left batch
    prefill keeps the online share (a client's next request, sent once its last was answered,
    finds the step planned ahead of it short too). Costs a batch job more, smaller steps. The
    daemon's default (`EngineArgs.batch_step_cap`); False: the whole budget while no online
    work is present."""
    max_offload_faults: int = 2
    """Storage faults a sequence goes through (recomputed after each); at this many it ends
    with a retryable error instead (`SequenceDelta.retryable`)."""

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches", "page_tokens", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 1:
            raise SchedulerConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        sizes = self.batch_sizes or discrete_sizes(self.max_step_tokens, None, self.block_size)
        sizes = tuple(sorted(set(sizes)))
        if sizes[0] < 1 or sizes[-1] > self.max_step_tokens:
            raise SchedulerConfigError(f"batch_sizes must lie in [1, max_step_tokens], got {sizes}")
        if sizes[-1] < self.block_size:
            raise SchedulerConfigError(
                f"the largest batch size ({sizes[-1]}) must hold one decode per sequence of the "
                f"block ({self.block_size}): raise max_step_tokens or lower the block size"
            )
        object.__setattr__(self, "batch_sizes", sizes)
        if not 0.0 < self.batch_share <= 1.0:
            raise SchedulerConfigError(f"batch_share must lie in (0, 1], got {self.batch_share}")
        unknown = set(self.kv_capacity_pages) - set(TIERS)
        if unknown:
            raise SchedulerConfigError(f"kv_capacity_pages has unknown tiers {sorted(unknown)}")

    @property
    def block_size(self) -> int:
        """Most sequences running at once (Policy.block_size)."""
        return self.gpu_batch_size * self.num_gpu_batches

    @classmethod
    def from_policy(cls, policy: Policy, **kwargs: object) -> SchedulerConfig:
        """Block shape and tier fractions from `policy`; everything else by keyword."""
        shape = {"gpu_batch_size": policy.gpu_batch_size, "num_gpu_batches": policy.num_gpu_batches}
        fracs = {"kv_frac": policy.kv_frac, "act_frac": policy.act_frac}
        return cls(**shape, **fracs, **kwargs)  # type: ignore[arg-type]


SIZES_PER_OCTAVE = 8
"""Discrete sizes between a power of two and the next, above the flat rows."""


def discrete_sizes(max_rows: int, flat_rows: int | None, block_size: int) -> tuple[int, ...]:
    """The dense batch sizes a step may run (NanoFlow 4.2): powers of two up to `flat_rows`,
    the rows below which a dense step's time does not grow (the device is under-used, so
    padding up is free); above them 8 sizes an octave, so that padding adds at most an
    eighth of a step's rows where every row costs time; the block size (a full block's
    decodes run unpadded) and max_rows. flat_rows None: 1 (every row costs)."""
    flat = max(1, min(flat_rows or 1, max_rows))
    base = 1 << (flat.bit_length() - 1)  # the largest power of two within the flat rows
    sizes = {1 << i for i in range(base.bit_length())}
    while base <= max_rows:
        step = max(1, base // SIZES_PER_OCTAVE)
        sizes |= set(range(base, min(2 * base, max_rows + 1), step))
        base *= 2
    sizes |= {min(block_size, max_rows), max_rows}
    return tuple(sorted(sizes))


def pick_size(batch_sizes: tuple[int, ...], num_tokens: int) -> int:
    """The dense size a step of `num_tokens` runs padded to: the smallest of `batch_sizes`
    that holds them, else the largest."""
    return next((s for s in batch_sizes if s >= num_tokens), batch_sizes[-1])
