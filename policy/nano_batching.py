"""The cost model's nano-batch terms (NanoFlow 4.3): dense ops cut into nano-batches, and the
compute task when the attention of one nano-batch overlaps the dense ops of another.

Per layer and GPU batch, with n nano-batches and f = (n - 1) / n:
- dense(n) = n max(FLOPs / n / gpu_flops, weight bytes / gpu_mem_bw) + layer_overhead_s
  + (n - 1) nano_batch_overhead_s: each nano-batch runs its own GEMMs, which read the whole
  layer's weights, and pays the fixed cost of a piece (launches, hand-offs). That is the
  nano-batch overhead (NanoFlow's "nano-batch-only" baseline, -13% in its Fig. 13), priced
  from the profile instead of taken from the paper.
- the engine runs every nano-batch's QKV projection first, then each output projection + MLP
  once its attention is done, so all but a fill and a drain of 1/n overlap: of the shorter of
  dense and attention, f hides, times the overlap efficiency `nanoflex profile` measured for
  the two running side by side (`nano_overlap_device`: two CUDA streams; `nano_overlap_host`:
  CPU attention on a CPU thread beside the device).
So the GPU lane takes G = D + A_gpu - e_dev f min(D, A_gpu) and the compute task
C = G + A_cpu - e_host f min(G, A_cpu) + the parts nothing overlaps. -min(a, b) = max(-a, -b),
so C is the max of four affine rows: the LP handles it like any other task.
"""

from __future__ import annotations

from policy.affine import Affine, MaxOf
from policy.hardware import HardwareSpec

MAX_COMPUTE_ROWS = 4
"""Affine rows of the compute task at most (`overlapped_compute`)."""


def dense_seconds(
    flops: float, weight_bytes: float, weight_elems: float, hardware: HardwareSpec, num_nano: int
) -> float:
    """One GPU batch's dense ops of one layer (`flops` in all, `weight_elems` weights of
    `weight_bytes` at full width) cut into `num_nano` nano-batches: each piece takes what the
    profile's dense step table measured for as many rows (scaled to the layer's size), else
    it is FLOP- or weight-read-bound at its own size; the layer pays its fixed cost once and
    each extra piece the profiled fixed cost of a nano-batch."""
    per_piece = hardware.dense_seconds(flops / num_nano, weight_elems)
    if per_piece is None:
        per_piece = max(
            flops / num_nano / hardware.gpu_flops, weight_bytes / hardware.gpu_mem_bw_estimate
        )
    fixed = hardware.layer_overhead_s + (num_nano - 1) * hardware.nano_batch_overhead_estimate
    return num_nano * per_piece + fixed


def hidden_share(num_nano: int, efficiency: float) -> float:
    """Share of the shorter of two overlapped lanes that nano-batching hides."""
    return efficiency * (num_nano - 1) / num_nano


def overlapped_compute(
    dense: float,
    gpu_attention: Affine,
    cpu_attention: Affine,
    serial: Affine,
    num_nano: int,
    hardware: HardwareSpec,
) -> MaxOf:
    """The compute task: `dense` seconds of dense ops (already cut, `dense_seconds`), attention
    on the compute device and on the CPU, and `serial` work nothing overlaps. With one
    nano-batch it is their sum (FlexGen: the GPU waits for the CPU attention of its batch)."""
    d = Affine.of(dense)
    if num_nano == 1:
        return MaxOf((d + gpu_attention + cpu_attention + serial,))
    keep_dev = 1 - hidden_share(num_nano, hardware.nano_overlap_device_estimate)
    keep_host = 1 - hidden_share(num_nano, hardware.nano_overlap_host_estimate)
    gpu_lane = (d * keep_dev + gpu_attention, d + gpu_attention * keep_dev)
    rows = [
        row + serial
        for g in gpu_lane
        for row in (g * keep_host + cpu_attention, g + cpu_attention * keep_host)
    ]
    return MaxOf(tuple(rows))
