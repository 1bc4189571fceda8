"""Measuring this machine's hardware constants through the engine's own paths, for the planner."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from base.pages import PAGE_TOKENS
from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.executor.attention import RaggedLayout, paged_attention, ragged_attention
from engine.executor.executor import Executor
from engine.kernels import attention_kernels
from engine.models.config import KVShape
from engine.profiling.copy_overlap import copy_compute_overlap
from engine.profiling.dense_profile import dense_step_table
from engine.profiling.disk_profile import disk_bandwidth, io_interference
from engine.profiling.load import LoadMonitor
from engine.profiling.nano_profile import nano_batch_overhead, nano_overlap
from engine.profiling.timing import Probe
from engine.storage.device import Device
from engine.storage.disk import DiskIO
from engine.storage.quant import dequantize, quantize
from policy import Policy
from policy.hardware import HardwareSpec, default_cache_path
from policy.machine import machine_key


def _copy_bw(
    name: str, src: torch.Tensor, dst: torch.Tensor, device: Device, probe: Probe
) -> float:
    nbytes = src.numel() * src.element_size()
    return nbytes / probe.seconds(name, lambda: dst.copy_(src, non_blocking=True), device)


def _matmul_flops(
    name: str, n: int, batch: int, dtype: torch.dtype, device: Device, probe: Probe
) -> float:
    a = torch.randn(batch, n, n, dtype=dtype, device=device.device)
    b = torch.randn(batch, n, n, dtype=dtype, device=device.device)
    return 2 * batch * n**3 / probe.seconds(name, lambda: torch.bmm(a, b), device)


def _bmm_flops(dtype: torch.dtype, device: Device, scale: int, probe: Probe) -> float:
    """Decode-attention-shaped batched matmul: (B*heads, 1, d) x (B*heads, d, L)."""
    heads, d, length = 32 * scale, 128, 512 * scale
    q = torch.randn(heads, 1, d, dtype=dtype, device=device.device)
    k = torch.randn(heads, d, length, dtype=dtype, device=device.device)
    return 2 * heads * d * length / probe.seconds("gpu_bmm_flops", lambda: torch.bmm(q, k), device)


ATTENTION_SHAPE = (16, 4, 64)
"""(heads, kv heads, head dim) of the CPU's attention probes: a small GQA model's layer."""
CUDA_ATTENTION_SHAPE = (32, 8, 128)
"""The same on CUDA: Llama-3-8B's layer (the models a GPU serves; 64-wide heads of 4 kv heads
read 128-byte rows, half the width the kernels are tuned for, and measured 36% of the copy rate
on the H200 where Llama's shape reached 67% in bench.gpu.attention)."""


def attention_shape(device: Device) -> tuple[int, int, int]:
    return CUDA_ATTENTION_SHAPE if device.is_cuda else ATTENTION_SHAPE


def paged_slots(lens: list[int], seed: int, page_tokens: int = PAGE_TOKENS) -> list[list[int]]:
    """Each sequence's KV slots as the engine lays them out: `page_tokens` consecutive rows a
    page, the pages of a pool of sum(ceil(len / page_tokens)) shuffled among the sequences (a
    token-by-token shuffle would price a gather the engine never does)."""
    counts = [-(-n // page_tokens) for n in lens]
    pages = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n, count in zip(lens, counts, strict=True):
        mine = pages[at : at + count]
        at += count
        out.append([mine[t // page_tokens] * page_tokens + t % page_tokens for t in range(n)])
    return out


def paged_pool(
    lens: list[int], row_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool of random KV rows `row_dim` wide holding sequences of `lens` tokens on shuffled
    pages (`paged_slots`), and each sequence's slots."""
    seq_slots = paged_slots(lens, seed)
    pool = torch.randn(1 + max(map(max, seq_slots)), row_dim, dtype=dtype, device=device)
    return pool, seq_slots


def _prefill_attention_flops(dtype: torch.dtype, device: Device, scale: int, probe: Probe) -> float:
    """FLOP/s of the engine's attention over prefill chunks (no past) read in place from a
    pool (`paged_attention` with the kernels the engine runs by default), counted as the
    cost model counts them: 4 s^2 q per sequence. On CUDA the chunks are long enough (8 of
    2,048 tokens at full scale, 550 GFLOP) that one call outlasts its launches."""
    heads, kv_heads, d = attention_shape(device)
    seqs, length = (8, 512 * scale) if device.is_cuda else (4, 128 * scale)
    on = device.device
    pool, seq_slots = paged_pool([length] * seqs, 2 * kv_heads * d, dtype, on, seed=0)
    layout = RaggedLayout.build([length] * seqs, [0] * seqs, on, seq_slots=seq_slots)
    q = torch.randn(seqs * length, heads, d, dtype=dtype, device=on)
    kernels = attention_kernels(device.is_cuda)
    seconds = probe.seconds(
        "prefill_attention_flops",
        lambda: paged_attention(q, pool, _plain, layout, KVShape(kv_heads, d), kernels),
        device,
    )
    return seqs * 4 * length**2 * heads * d / seconds


def _device_attention_bw(
    dtype: torch.dtype, device: Device, scale: int, probe: Probe, packed: bool = False
) -> float:
    """KV bytes/s of decode attention through the engine's path on the compute device: every
    key of a sequence read in place from a pool by slot (`paged_attention`, where the KV is
    on the compute device's pool), by the kernels the engine runs by default (gathered into
    the padded layout for one SDPA without them). On CUDA the step reads 537 MB at full
    scale (32 sequences of 4,096 keys), so HBM, not the launches, is what it measures. Keys
    on shuffled pages (`paged_slots`), as the engine stores them.
    `packed`: without the kernels, every key gathered into a padded copy for SDPA, as
    nano-batched steps read their KV (`packed_attention_bw`)."""
    heads, kv_heads, d = attention_shape(device)
    seqs, past = (32, 1024 * scale) if device.is_cuda else (8, 256 * scale)
    on = device.device
    pool, seq_slots = paged_pool([past + 1] * seqs, 2 * kv_heads * d, dtype, on, seed=1)
    layout = RaggedLayout.build([1] * seqs, [past] * seqs, on, seq_slots=seq_slots)
    q = torch.randn(seqs, heads, d, dtype=dtype, device=on)
    kernels = None if packed else attention_kernels(device.is_cuda)
    seconds = probe.seconds(
        "packed_attention_bw" if packed else "device_attention_bw",
        lambda: paged_attention(q, pool, _plain, layout, KVShape(kv_heads, d), kernels),
        device,
    )
    return seqs * (past + 1) * 2 * kv_heads * d * pool.element_size() / seconds


def _plain(rows: torch.Tensor) -> torch.Tensor:
    """A plain KV pool's rows need no decoding."""
    return rows


def _cpu_attention(threads: int, kv_tokens: int, probe: Probe) -> float:
    """KV bytes/s consumed by decode attention on the CPU with `threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch, heads, kv_heads, d = 8, 32, 8, 128
        layout = RaggedLayout.build([1] * batch, [kv_tokens - 1] * batch, torch.device("cpu"))
        q = torch.randn(batch, heads, d)
        k, v = torch.randn(batch, kv_heads, d), torch.randn(batch, kv_heads, d)
        past_k = torch.randn(batch * (kv_tokens - 1), kv_heads, d)
        past_v = torch.randn_like(past_k)
        seconds = probe.seconds(
            "cpu_attention_throughput",
            lambda: ragged_attention(q, k, v, past_k, past_v, layout),
            Device(torch.device("cpu")),
        )
        return 2 * batch * kv_tokens * kv_heads * d * 4 / seconds
    finally:
        torch.set_num_threads(previous)


def _layer_overhead(device_name: str, probe: Probe, spec: HardwareSpec) -> float:
    """Seconds per decoder layer of a one-token step of the demo model through the engine,
    less what `spec`'s dense step table charges for its one-row matmuls (the cost model adds
    those by size): launches, Python, the pipeline's hand-offs."""
    executor = Executor(EngineArgs(model=DEMO_MODEL, device=device_name), Policy(gpu_batch_size=1))
    try:
        # two one-token steps: a prefill of one token, then one decode reading it back
        seconds = probe.seconds(
            "layer_overhead_s", lambda: executor.score([[5, 6]], prefill_len=1), executor.device
        )
        num_layers = executor.config.num_layers
        element = torch.empty((), dtype=executor.dtype).element_size()
        elems = sum(executor.weights.planned_bytes().values()) / element / num_layers
        dense = spec.dense_seconds(2 * elems, elems) or 0.0
        return max(seconds / 2 / num_layers - dense, 0.0)
    finally:
        executor.close()


def profile_hardware(
    device_name: str = "auto", offload_dir: str | None = None, quick: bool = False
) -> HardwareSpec:
    """Measure every constant of `HardwareSpec` on this machine, watching what else runs
    meanwhile (`HardwareSpec.machine_load`, engine/profiling/load.py): each timing is the fastest of
    several samples after a warm-up, its spread recorded (`HardwareSpec.spread`), and a
    measurement that spreads wider than `MAX_SPREAD` is taken again. `quick` uses small sizes
    (seconds instead of a minute): for a first automatic plan, not for reporting."""
    with LoadMonitor() as watch:
        spec = _measure(device_name, offload_dir, quick, watch)
    return dataclasses.replace(spec, machine_load=watch.report.to_dict())


def _measure(
    device_name: str, offload_dir: str | None, quick: bool, watch: LoadMonitor
) -> HardwareSpec:
    import psutil

    # quick: fewer samples and one retake (the planner may re-measure a noisy quick profile);
    # no retake at all while the machine is busy (Probe)
    probe = Probe(repeats=3, retries=1, watch=watch) if quick else Probe(watch=watch)
    device = Device.resolve(device_name)
    scale = 1 if quick else 4
    nbytes = (32 if quick else 256) << 20
    dtype = torch.float16 if device.is_cuda else torch.float32
    cpu = Device(torch.device("cpu"))
    host = device.host_empty((nbytes,), torch.uint8)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device.device)
    ctog = _copy_bw("ctog_bw", host, on_device, device, probe)
    gtoc = _copy_bw("gtoc_bw", on_device, host, device, probe)
    gpu_mem_bw = _copy_bw("gpu_mem_bw", on_device, torch.empty_like(on_device), device, probe)
    cpu_src = torch.empty(nbytes, dtype=torch.uint8)
    cpu_mem_bw = _copy_bw("cpu_mem_bw", cpu_src, torch.empty_like(cpu_src), cpu, probe)
    del host, on_device, cpu_src
    root = Path(offload_dir) if offload_dir else Path(tempfile.mkdtemp(prefix="nanoflex-profile-"))
    disk = DiskIO(root, 4)
    try:
        dtoc, ctod = disk_bandwidth(disk, nbytes, device, probe)
        interference = {"rounds": 1, "products": 8} if quick else {}
        io_small, io_large = (
            (0.0, 0.0) if device.is_cuda else io_interference(disk, probe, **interference)
        )
    finally:
        disk.close()
        if not offload_dir:
            shutil.rmtree(root, ignore_errors=True)
    n = 1024 * (2 if scale > 1 else 1)
    gpu_flops = _matmul_flops(
        "gpu_flops", n * (4 if device.is_cuda else 1) // 2, 2, dtype, device, probe
    )
    cpu_flops = _matmul_flops("cpu_flops", n // 2, 2, torch.float32, cpu, probe)
    cores = os.cpu_count() or 1
    thread_counts = sorted({1, max(1, cores // 2), cores})
    attention = tuple((t, _cpu_attention(t, 256 * scale, probe)) for t in thread_counts)
    hidden = (4096 if device.is_cuda else 1024) // (1 if scale > 1 else 2)
    dense, dense_params = dense_step_table(
        device, dtype, hidden, max_rows=4 * hidden if device.is_cuda else 1024, probe=probe
    )
    weight = torch.randn(1024 * scale, 1024, dtype=dtype, device=device.device)
    packed = quantize(weight, 64, dim=0)
    dequant = weight.numel() / probe.seconds(
        "dequant_throughput", lambda: dequantize(packed), device
    )
    nano_device, nano_host = nano_overlap(device, dtype, quick)
    # a layer-sized copy beside GEMMs, as the zig-zag schedule runs them (CUDA events)
    copy_hidden = copy_compute_overlap(device.device, nbytes).hidden if device.is_cuda else None
    memory = psutil.virtual_memory().total
    if device.is_cuda:
        gpu_mem = torch.cuda.get_device_properties(device.device).total_memory
        cpu_mem = memory
        name = torch.cuda.get_device_name(device.device)
    else:  # the "gpu" tier is the compute device's (host) memory: split it with the cpu tier
        gpu_mem = cpu_mem = memory // 2
        name = "cpu"
    disk_free = shutil.disk_usage(offload_dir or tempfile.gettempdir()).free
    spec = HardwareSpec(
        gpu_mem_bytes=int(gpu_mem),
        cpu_mem_bytes=int(cpu_mem),
        disk_mem_bytes=int(disk_free),
        ctog_bw=ctog,
        gtoc_bw=gtoc,
        dtoc_bw=dtoc,
        ctod_bw=ctod,
        gpu_flops=gpu_flops,
        gpu_bmm_flops=_bmm_flops(dtype, device, scale, probe),
        cpu_flops=cpu_flops,
        num_cpu_cores=cores,
        gpu_mem_bw=gpu_mem_bw,
        cpu_mem_bw=cpu_mem_bw,
        cpu_attention_throughput=attention,
        dequant_throughput=dequant,
        dense_step_table=dense,
        dense_step_params=dense_params,
        prefill_attention_flops=_prefill_attention_flops(dtype, device, scale, probe),
        device_attention_bw=_device_attention_bw(dtype, device, scale, probe),
        packed_attention_bw=_device_attention_bw(dtype, device, scale, probe, packed=True),
        io_compute_share_small=io_small,
        io_compute_share_large=io_large,
        nano_overlap_device=nano_device,
        nano_overlap_host=nano_host,
        copy_hidden=copy_hidden,
        nano_batch_overhead_s=nano_batch_overhead(device_name, probe),
        compute_device="cuda" if device.is_cuda else "cpu",
        machine=machine_key(),
        quick=quick,
        notes=f"{name}; torch {torch.__version__}; measured {time.strftime('%Y-%m-%d %H:%M')}"
        + (" (quick)" if quick else ""),
    )
    overhead = _layer_overhead(device_name, probe, spec)  # less the dense work spec charges
    spread = dict(sorted(probe.spread.items()))
    return dataclasses.replace(spec, layer_overhead_s=overhead, spread=spread)


def main(argv: list[str]) -> int:
    """`python -m engine.profiling.profiler [DEVICE [OUT]]`: measure a quick profile and write it
    to OUT (default: the cache), as the planner does when it needs one."""
    device_name = argv[1] if len(argv) > 1 else "auto"
    out = Path(argv[2]) if len(argv) > 2 else default_cache_path()
    profile_hardware(device_name, quick=True).save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
