"""Measuring this machine's hardware constants through the engine's own paths, for the planner."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch

from engine.core.model_files import DEMO_MODEL
from engine.executor.attention import RaggedLayout, ragged_attention
from engine.executor.executor import Executor
from engine.executor.nano_profile import nano_batch_overhead, nano_overlap
from engine.executor.timing import best_seconds
from engine.storage.device import Device
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.quant import dequantize, quantize
from policy import Policy
from policy.hardware import HardwareSpec, default_cache_path


def _copy_bw(src: torch.Tensor, dst: torch.Tensor, device: Device) -> float:
    nbytes = src.numel() * src.element_size()
    return nbytes / best_seconds(lambda: dst.copy_(src, non_blocking=True), device)


def _matmul_flops(
    n: int, batch: int, dtype: torch.dtype, where: torch.device, device: Device
) -> float:
    a = torch.randn(batch, n, n, dtype=dtype, device=where)
    b = torch.randn(batch, n, n, dtype=dtype, device=where)
    return 2 * batch * n**3 / best_seconds(lambda: torch.bmm(a, b), device)


def _bmm_flops(dtype: torch.dtype, device: Device, scale: int) -> float:
    """Decode-attention-shaped batched matmul: (B*heads, 1, d) x (B*heads, d, L)."""
    heads, d, length = 32 * scale, 128, 512 * scale
    q = torch.randn(heads, 1, d, dtype=dtype, device=device.device)
    k = torch.randn(heads, d, length, dtype=dtype, device=device.device)
    return 2 * heads * d * length / best_seconds(lambda: torch.bmm(q, k), device)


def _disk_bw(disk: DiskIO, nbytes: int, device: Device) -> tuple[float, float]:
    """(read, write) bytes/s through the engine's own disk path: pwrite + fsync, then pread
    after dropping the page cache, with the copy-thread pool and pinned staging."""
    data = device.host_empty((nbytes,), torch.uint8)
    data.random_(0, 255)
    f = disk.open("profile.bin")
    start = time.perf_counter()
    disk.write(f, 0, data)
    os.fsync(f.fd)
    write_bw = nbytes / (time.perf_counter() - start)
    f.drop_cache()
    start = time.perf_counter()
    disk.read(f, 0, data)
    read_bw = nbytes / (time.perf_counter() - start)
    return read_bw, write_bw


IO_INTERFERENCE_READS = (64 << 10, 4 << 20)
"""Read sizes of the interference probe: a KV page run, a weight chunk."""


def _io_interference(disk: DiskIO) -> tuple[float, float]:
    """(small, large): the share of its rate CPU compute loses while the copy threads read
    from disk with small (64 KiB) or large (4 MiB) reads, each dropped from the page cache
    as the engine does. On a CPU-only box the copies and the compute share the cores."""
    f = disk.open("interference.bin")
    disk.write(f, 0, torch.zeros(64 << 20, dtype=torch.uint8))
    a, b = torch.randn(512, 512), torch.randn(512, 1408)

    def matmul_ms(repeats: int = 60) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        return (time.perf_counter() - start) / repeats

    shares = []
    for size in IO_INTERFERENCE_READS:
        alone, busy = [], []
        for _ in range(3):
            alone.append(matmul_ms())
            stop = threading.Event()
            reader = threading.Thread(target=_read_until, args=(disk, f, size, stop))
            reader.start()
            busy.append(matmul_ms())
            stop.set()
            reader.join()
        share = 1.0 - statistics.median(alone) / statistics.median(busy)
        shares.append(min(max(share, 0.0), 1.0))
    return shares[0], shares[1]


def _read_until(disk: DiskIO, f: DiskFile, size: int, stop: threading.Event) -> None:
    buf = torch.empty(size, dtype=torch.uint8)
    offset = 0
    while not stop.is_set():
        disk.read(f, offset, buf)
        offset = (offset + 16 * size) % ((64 << 20) - size)


def _cpu_attention(threads: int, kv_tokens: int) -> float:
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
        seconds = best_seconds(
            lambda: ragged_attention(q, k, v, past_k, past_v, layout), Device(torch.device("cpu"))
        )
        return 2 * batch * kv_tokens * kv_heads * d * 4 / seconds
    finally:
        torch.set_num_threads(previous)


def _dense_step_table(
    device: Device, dtype: torch.dtype, hidden: int, max_rows: int
) -> tuple[tuple[int, float], ...]:
    """(token rows, seconds) of one reference layer's dense matmuls (QKV, output, MLP up and
    down) for power-of-two row counts: where rows/s stops growing is the knee the discrete
    batch sizes start from (NanoFlow 4.2)."""
    where = device.device
    weights = [
        torch.randn(hidden, 3 * hidden, dtype=dtype, device=where),
        torch.randn(hidden, hidden, dtype=dtype, device=where),
        torch.randn(hidden, 4 * hidden, dtype=dtype, device=where),
        torch.randn(4 * hidden, hidden, dtype=dtype, device=where),
    ]
    x = torch.randn(max_rows, 4 * hidden, dtype=dtype, device=where)
    table = []
    rows = 1
    while rows <= max_rows:
        inputs = [x[:rows, : w.shape[0]] for w in weights]
        table.append((rows, best_seconds(partial(_matmuls, inputs, weights), device)))
        rows *= 2
    return tuple(table)


def _matmuls(inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [a @ w for a, w in zip(inputs, weights, strict=True)]


def _layer_overhead(device_name: str) -> float:
    """Seconds per decoder layer of a one-token step of the demo model through the engine:
    almost all fixed cost (its matmuls at batch 1 are a few percent of it)."""
    executor = Executor(DEMO_MODEL, Policy(gpu_batch_size=1), device=device_name)
    try:
        # two one-token steps: a prefill of one token, then one decode reading it back
        seconds = best_seconds(lambda: executor.score([[5, 6]], prefill_len=1), executor.device)
        return seconds / 2 / executor.config.num_layers
    finally:
        executor.close()


def profile_hardware(
    device_name: str = "auto", offload_dir: str | None = None, quick: bool = False
) -> HardwareSpec:
    """Measure every constant of `HardwareSpec` on this machine. `quick` uses small sizes
    (seconds instead of a minute): for a first automatic plan, not for reporting."""
    import psutil

    device = Device.resolve(device_name)
    scale = 1 if quick else 4
    nbytes = (32 if quick else 256) << 20
    dtype = torch.float16 if device.is_cuda else torch.float32
    host = device.host_empty((nbytes,), torch.uint8)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device.device)
    ctog = _copy_bw(host, on_device, device)
    gtoc = _copy_bw(on_device, host, device)
    gpu_mem_bw = _copy_bw(on_device, torch.empty_like(on_device), device)
    cpu_src = torch.empty(nbytes, dtype=torch.uint8)
    cpu_mem_bw = _copy_bw(cpu_src, torch.empty_like(cpu_src), Device(torch.device("cpu")))
    root = Path(offload_dir) if offload_dir else Path(tempfile.mkdtemp(prefix="nanoflex-profile-"))
    disk = DiskIO(root, 4)
    try:
        dtoc, ctod = _disk_bw(disk, nbytes, device)
        io_small, io_large = (0.0, 0.0) if device.is_cuda else _io_interference(disk)
    finally:
        disk.close()
        if not offload_dir:
            shutil.rmtree(root, ignore_errors=True)
    n = 1024 * (2 if scale > 1 else 1)
    gpu_flops = _matmul_flops(
        n * (4 if device.is_cuda else 1) // 2, 2, dtype, device.device, device
    )
    cpu_flops = _matmul_flops(
        n // 2, 2, torch.float32, torch.device("cpu"), Device(torch.device("cpu"))
    )
    bmm = _bmm_flops(dtype, device, scale)
    cores = os.cpu_count() or 1
    thread_counts = sorted({1, max(1, cores // 2), cores})
    attention = tuple((t, _cpu_attention(t, 256 * scale)) for t in thread_counts)
    hidden = (4096 if device.is_cuda else 1024) // (1 if scale > 1 else 2)
    dense = _dense_step_table(
        device, dtype, hidden, max_rows=4 * hidden if device.is_cuda else 1024
    )
    weight = torch.randn(1024 * scale, 1024, dtype=dtype, device=device.device)
    packed = quantize(weight, 64, dim=0)
    dequant = weight.numel() / best_seconds(lambda: dequantize(packed), device)
    nano_device, nano_host = nano_overlap(device, dtype, quick)
    memory = psutil.virtual_memory().total
    if device.is_cuda:
        gpu_mem = torch.cuda.get_device_properties(device.device).total_memory
        cpu_mem = memory
        name = torch.cuda.get_device_name(device.device)
    else:  # the "gpu" tier is the compute device's (host) memory: split it with the cpu tier
        gpu_mem = cpu_mem = memory // 2
        name = "cpu"
    disk_free = shutil.disk_usage(offload_dir or tempfile.gettempdir()).free
    return HardwareSpec(
        gpu_mem_bytes=int(gpu_mem),
        cpu_mem_bytes=int(cpu_mem),
        disk_mem_bytes=int(disk_free),
        ctog_bw=ctog,
        gtoc_bw=gtoc,
        dtoc_bw=dtoc,
        ctod_bw=ctod,
        gpu_flops=gpu_flops,
        gpu_bmm_flops=bmm,
        cpu_flops=cpu_flops,
        num_cpu_cores=cores,
        gpu_mem_bw=gpu_mem_bw,
        cpu_mem_bw=cpu_mem_bw,
        cpu_attention_throughput=attention,
        dequant_throughput=dequant,
        dense_step_table=dense,
        io_compute_share_small=io_small,
        io_compute_share_large=io_large,
        nano_overlap_device=nano_device,
        nano_overlap_host=nano_host,
        layer_overhead_s=_layer_overhead(device_name),
        nano_batch_overhead_s=nano_batch_overhead(device_name),
        compute_device="cuda" if device.is_cuda else "cpu",
        notes=f"{name}; torch {torch.__version__}; measured {time.strftime('%Y-%m-%d %H:%M')}"
        + (" (quick)" if quick else ""),
    )


def main(argv: list[str]) -> int:
    """`python -m engine.executor.profiler [DEVICE]`: measure a quick profile and cache it (the
    planner runs this in a child process the first time it needs a profile)."""
    device_name = argv[1] if len(argv) > 1 else "auto"
    print("nanoflex: no hardware profile cached; measuring a quick one", file=sys.stderr)
    profile_hardware(device_name, quick=True).save(default_cache_path())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
