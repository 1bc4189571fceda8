"""The cost model's terms for a hybrid's per-sequence states (policy/hybrid.py).

Every step, each state layer reads each sequence's state onto the compute device and writes it
back, once for a decode and once for a prefill chunk: a state homed in host memory (the
sequences whose KV is on the cpu or disk tier, fractions cc and cd) crosses PCIe both ways, one
on the gpu tier (cg) does not. The engine copies states in line with the layer, on the compute
thread, so those copies are priced as serial compute, not as overlapped copy tasks. Computing
a state layer outside its projections (which the weight FLOPs count) is a recurrent step per
decode, memory-bound on the state it reads and writes, and a chunked scan per prompt. Like
every term of the cost model, these are seconds per layer averaged over the layers (a state
layer's cost times the state layers' share).
Legend: bls block size, s prompt_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from policy.affine import ZERO, Affine
from policy.hardware import HardwareSpec
from policy.hybrid import RECURRENT_BYTES
from policy.policy import Policy
from policy.specs import ModelSpec


@dataclass(frozen=True)
class StateTerms:
    """A hybrid's state terms for one block; all zero for a transformer."""

    sequence_bytes: float
    """One sequence's state over every state layer: what its slot holds on its tier."""
    layer_bytes: float
    """One sequence's state in one state layer: what a layer gathers onto the compute device
    per sequence."""
    host_bytes: float
    """Bytes per layer (averaged) the block's host-homed states cross PCIe, each way, per
    decode step and per prefill: bls x sequence_bytes / L (times cc + cd)."""
    host_seconds: Affine
    """Seconds of those copies, in and out: the engine makes them on the compute thread, in
    line with the layer (engine/storage/state_store.py), so they overlap nothing."""
    decode_seconds: float
    """Compute device seconds per layer (averaged) of the block's recurrent steps."""
    prefill_seconds: float
    """Compute device seconds per layer (averaged) of the block's chunked scans over s."""
    prefill_workspace: float
    """Bytes one sequence's prompt needs in a state layer beyond its state: its projections
    (about twice the convolution's channels per token) and the chunked scan's per-chunk
    states (float32)."""


NO_STATES = StateTerms(0.0, 0.0, 0.0, ZERO, 0.0, 0.0, 0.0)


def state_terms(model: ModelSpec, hardware: HardwareSpec, bls: int, s: float) -> StateTerms:
    """The state terms of a block of `bls` sequences with prompts of `s` tokens."""
    shape = model.state
    if shape is None:
        return NO_STATES
    share = model.state_layer_share
    layer_bytes = float(model.state_bytes_per_layer)
    host = bls * model.state_bytes_per_sequence / model.num_layers
    round_trip = host / hardware.ctog_bw + host / hardware.gtoc_bw
    # A decode step reads and writes each state once on the compute device.
    decode_one = max(
        shape.decode_flops / hardware.gpu_bmm_flops, 2 * layer_bytes / hardware.gpu_mem_bw_estimate
    )
    prefill_one = (
        s * shape.prefill_flops / hardware.gpu_bmm_flops
        + 2 * layer_bytes / hardware.gpu_mem_bw_estimate
    )
    chunks = math.ceil(s / shape.chunk) + 1
    workspace = (
        s * 2 * shape.conv_channels * model.dtype_bytes
        + chunks * shape.recurrent_elements * RECURRENT_BYTES
    )
    return StateTerms(
        sequence_bytes=float(model.state_bytes_per_sequence),
        layer_bytes=layer_bytes,
        host_bytes=host,
        host_seconds=Affine.of(cc=round_trip, cd=round_trip),
        decode_seconds=share * bls * decode_one,
        prefill_seconds=share * bls * prefill_one,
        prefill_workspace=workspace,
    )


def state_bytes_per_tier(model: ModelSpec, policy: Policy) -> dict[str, float]:
    """Bytes the block's states take on each tier under `policy`: the gpu tier's sequences
    keep theirs there, the cpu and disk tiers' in host memory."""
    block = policy.block_size * model.state_bytes_per_sequence
    gpu, cpu, disk = policy.kv_frac
    return {"gpu": gpu * block, "cpu": (cpu + disk) * block, "disk": 0.0}


def state_summary(model: ModelSpec, policy: Policy, peak_bytes: dict[str, float]) -> dict[str, Any]:
    """A hybrid's state numbers for `nanoflex plan --json` and bench/results: its size per
    sequence beside the KV per token, and its bytes and share of the peak on each tier."""
    per_tier = state_bytes_per_tier(model, policy)
    return {
        "num_layers": model.num_layers,
        "num_state_layers": model.num_state_layers,
        "num_kv_layers": model.num_kv_layers,
        "state_bytes_per_sequence": model.state_bytes_per_sequence,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "state_bytes": per_tier,
        "state_share_of_peak": {
            tier: per_tier[tier] / peak_bytes[tier] if peak_bytes[tier] else 0.0
            for tier in per_tier
        },
    }
