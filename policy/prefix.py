"""When loading cached KV beats recomputing it: the prefix cache's break-even per tier.

A prompt prefix found in the cache on tier T can be loaded back (its KV bytes cross from
T to the compute device) or recomputed (a prefill of those tokens). Loading costs
n x kv_bytes_per_token / bandwidth(T); recomputing costs the prefill's dense FLOPs,
linear in n, plus its attention, quadratic in n. So where a tier's bytes are slower
than the dense FLOPs per token (disk on a fast GPU), short hits lose and long ones
win: the break-even is the shortest prefix worth loading. The scheduler recomputes
shorter hits on that tier (SchedulerConfig.min_hit_tokens); `nanoflex plan` reports it.
"""

from __future__ import annotations

from base.pages import PAGE_TOKENS
from policy.cost_model import compressed_bytes_per_element
from policy.hardware import HardwareSpec
from policy.policy import TIERS
from policy.specs import ModelSpec

MAX_PREFIX_TOKENS = 1 << 17
"""Beyond this a prefix is never worth loading from that tier (reported as None)."""


def load_seconds(
    num_tokens: int, tier: str, model: ModelSpec, hardware: HardwareSpec, compress_kv: bool
) -> float:
    """Seconds to bring `num_tokens` of cached KV (every layer) from `tier` to the compute
    device; a hybrid's hit also copies the state saved at the prefix's end, from host
    memory (engine/core/state_slots.py, `StateSnapshots`)."""
    per_token = float(model.kv_bytes_per_token)
    if compress_kv:
        per_token *= compressed_bytes_per_element(model.dtype_bytes) / model.dtype_bytes
    nbytes = num_tokens * per_token
    state = model.state_bytes_per_sequence / hardware.ctog_bw if model.is_hybrid else 0.0
    if tier == "gpu":
        return state
    seconds = nbytes / hardware.ctog_bw
    if tier == "disk":
        seconds += nbytes / hardware.dtoc_bw
    return seconds + state


def recompute_seconds(num_tokens: int, model: ModelSpec, hardware: HardwareSpec) -> float:
    """Seconds to prefill `num_tokens` with the weights on the compute device (an MoE model
    computes its active parameters only)."""
    q_dim = model.num_heads * model.head_dim
    dense = num_tokens * 2 * model.active_layer_params / hardware.gpu_flops
    pairs = model.kv_layer_share * model.attention_pairs(num_tokens)
    attention = 4 * pairs * q_dim / hardware.gpu_bmm_flops
    return model.num_layers * (dense + attention + hardware.layer_overhead_s)


def break_even_tokens(
    model: ModelSpec,
    hardware: HardwareSpec,
    page_tokens: int = PAGE_TOKENS,
    compress_kv: bool = False,
) -> dict[str, int | None]:
    """Per tier, the shortest prefix (a whole number of pages) that loads at least as fast
    as it recomputes; None when none up to MAX_PREFIX_TOKENS does."""

    def loads_faster(n: int, tier: str) -> bool:
        return load_seconds(n, tier, model, hardware, compress_kv) <= recompute_seconds(
            n, model, hardware
        )

    sizes = range(page_tokens, MAX_PREFIX_TOKENS + 1, page_tokens)
    return {tier: next((n for n in sizes if loads_faster(n, tier)), None) for tier in TIERS}
