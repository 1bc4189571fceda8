"""Roofline: an upper bound on generation throughput for a model, workload, machine and budget.

Optimistic by construction (a bound, not a prediction): every copy, compute and
CPU task overlaps perfectly, weights take the GPU budget first, the KV cache takes
what is left of it, and no workspace is counted. For a block of B sequences,
prompt s, generation n (FlexGen's generation throughput = B * n / total time):

- PCIe bound: weights not on the GPU cross host->device once per step (1 prefill +
  n - 1 decode steps); weights beyond the host budget come from disk first:
  B * n / (n * (W_off / ctog_bw + W_disk / dtoc_bw)).
- HBM bound: each step reads the GPU-resident weights, and each decode step the
  GPU-resident KV cache, from device memory at gpu_mem_bw (what caps small batches).
- compute bound (NanoFlow Eq. 9): every token processed costs 2 * params FLOPs,
  so Compute / (2 * params) tokens/s over all B * (s + n) tokens, i.e.
  gpu_flops * n / (2 * params * (s + n)) generated tokens/s. Attention FLOPs are left out.
- CPU-attention bound: each decode step reads the off-GPU share of the block's KV
  cache (mean length s + n/2) once, on the CPU (cpu_attention_bw) or over PCIe
  (ctog_bw), whichever is faster.

`roofline` evaluates one block size and storage format; `best_roofline` the best
over every block size the GPU + host budgets can hold (the KV cache at s + n) and,
unless told otherwise, over 4-bit weights and KV cache too (FlexGen's group-wise
format), so that no policy the search may pick can beat it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from policy.cost_model import compressed_bytes_per_element
from policy.hardware import HardwareSpec
from policy.specs import ModelSpec, WorkloadSpec

MAX_BLOCK_SIZE = 1 << 16


@dataclass(frozen=True)
class Roofline:
    """Bounds on generation throughput (tokens/s) at one block size; inf where none applies."""

    block_size: int
    compress_weights: bool
    compress_kv: bool
    pcie_bound: float
    hbm_bound: float
    compute_bound: float
    cpu_attention_bound: float
    compute_bound_all_tokens: float
    """NanoFlow Eq. 9 as written: gpu_flops / (2 * params), prefill and decode tokens alike."""
    weights_off_gpu_bytes: float
    kv_off_gpu_frac: float

    @property
    def bound(self) -> float:
        return min(self.pcie_bound, self.hbm_bound, self.compute_bound, self.cpu_attention_bound)

    @property
    def limit(self) -> str:
        bounds = {
            "pcie": self.pcie_bound,
            "hbm": self.hbm_bound,
            "compute": self.compute_bound,
            "cpu_attention": self.cpu_attention_bound,
        }
        return min(bounds, key=lambda k: bounds[k])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bound": self.bound, "limit": self.limit}


def roofline(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    *,
    block_size: int,
    gpu_mem: float | None = None,
    cpu_mem: float | None = None,
    compress_weights: bool = False,
    compress_kv: bool = False,
) -> Roofline:
    """The bounds for a block of `block_size` sequences (budgets default to the machine's)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    s, n, b = workload.prompt_len, workload.gen_len, block_size
    gpu_budget = float(hardware.gpu_mem_bytes if gpu_mem is None else gpu_mem)
    cpu_budget = float(hardware.cpu_mem_bytes if cpu_mem is None else cpu_mem)
    packed = compressed_bytes_per_element(model.dtype_bytes) / model.dtype_bytes
    weights = model.total_weight_bytes * (packed if compress_weights else 1.0)
    kv_tok_full = float(model.kv_bytes_per_token)  # all layers
    kv_tok = kv_tok_full * (packed if compress_kv else 1.0)

    weights_gpu = min(weights, gpu_budget)
    weights_off = weights - weights_gpu
    weights_disk = max(0.0, weights_off - cpu_budget)
    io_seconds = n * (weights_off / hardware.ctog_bw + weights_disk / hardware.dtoc_bw)
    pcie = b * n / io_seconds if io_seconds > 0 else math.inf

    params = float(model.total_params)
    compute_all = hardware.gpu_flops / (2 * params)
    compute = compute_all * n / (s + n)

    kv_total = b * (s + n) * kv_tok
    kv_room = gpu_budget - weights_gpu
    kv_off_frac = max(0.0, 1.0 - kv_room / kv_total)
    q_dim = model.num_heads * model.head_dim
    flops_per_kv_byte = 4 * q_dim / model.kv_bytes_per_token_per_layer
    read_bw = max(hardware.cpu_attention_bw(0, flops_per_kv_byte), hardware.ctog_bw)
    attention_seconds = (n - 1) * kv_off_frac * b * (s + n / 2) * kv_tok_full / read_bw
    attention = b * n / attention_seconds if attention_seconds > 0 else math.inf

    kv_gpu_read = (1.0 - kv_off_frac) * b * (s + n / 2) * kv_tok
    hbm_seconds = (n * weights_gpu + (n - 1) * kv_gpu_read) / hardware.gpu_mem_bw_estimate
    hbm = b * n / hbm_seconds if hbm_seconds > 0 else math.inf
    return Roofline(
        block_size=b,
        compress_weights=compress_weights,
        compress_kv=compress_kv,
        pcie_bound=pcie,
        hbm_bound=hbm,
        compute_bound=compute,
        cpu_attention_bound=attention,
        compute_bound_all_tokens=compute_all,
        weights_off_gpu_bytes=weights_off,
        kv_off_gpu_frac=kv_off_frac,
    )


def max_block_size(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    *,
    gpu_mem: float | None = None,
    cpu_mem: float | None = None,
    compress_weights: bool = False,
    compress_kv: bool = False,
) -> int:
    """Most sequences whose KV cache (at s + n) fits beside the weights in GPU + host budgets."""
    gpu_budget = float(hardware.gpu_mem_bytes if gpu_mem is None else gpu_mem)
    cpu_budget = float(hardware.cpu_mem_bytes if cpu_mem is None else cpu_mem)
    packed = compressed_bytes_per_element(model.dtype_bytes) / model.dtype_bytes
    weights = model.total_weight_bytes * (packed if compress_weights else 1.0)
    kv_seq = workload.total_len * model.kv_bytes_per_token * (packed if compress_kv else 1.0)
    free = gpu_budget + cpu_budget - weights
    return max(0, min(MAX_BLOCK_SIZE, int(free // kv_seq)))


def best_roofline(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    *,
    gpu_mem: float | None = None,
    cpu_mem: float | None = None,
    allow_compression: bool = True,
) -> Roofline | None:
    """The highest bound over every block size that fits (and every storage format when
    `allow_compression`); None when not one sequence fits."""
    formats = [(False, False)]
    if allow_compression:
        formats += [(True, False), (False, True), (True, True)]
    best: Roofline | None = None
    for compress_weights, compress_kv in formats:
        kwargs: dict[str, Any] = dict(
            gpu_mem=gpu_mem,
            cpu_mem=cpu_mem,
            compress_weights=compress_weights,
            compress_kv=compress_kv,
        )
        for b in range(1, max_block_size(model, workload, hardware, **kwargs) + 1):
            r = roofline(model, workload, hardware, block_size=b, **kwargs)
            if best is None or r.bound > best.bound:
                best = r
    return best
