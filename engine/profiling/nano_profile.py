"""What the cost model's nano-batch term needs from `nanoflex profile` (NanoFlow 4.3): how much
of two operations disappears when they run side by side, and what a nano-batch costs."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.core.protocol import SeqChunk, StepPlan
from engine.core.sampling_params import SamplingParams
from engine.executor.attention import RaggedLayout, ragged_attention
from engine.executor.executor import Executor
from engine.profiling.timing import Probe, best_seconds
from engine.storage.device import Device
from policy import Policy


def _overlap_share(
    first: Callable[[], object],
    second: Callable[[], object],
    both: Callable[[], object],
    device: Device,
    rounds: int = 5,
) -> float:
    """Share of the shorter of two operations that disappears when they run side by side: the
    median over `rounds` rounds, each timing both alone and together (a shared machine's noise
    moves single timings by tens of percent)."""
    shares = []
    for _ in range(rounds):
        alone = best_seconds(first, device), best_seconds(second, device)
        together = best_seconds(both, device)
        shares.append(min(max((sum(alone) - together) / min(alone), 0.0), 1.0))
    return statistics.median(shares)


def nano_overlap(device: Device, dtype: torch.dtype, quick: bool) -> tuple[float, float]:
    """(device, host): what nano-batching can hide (NanoFlow 4.3). Device: dense matmuls beside
    a decode attention on a second CUDA stream (a second thread where the compute device is the
    CPU). Host: the same matmuls beside CPU attention on a CPU thread. The matmuls are repeated
    until they take about as long as the attention, so either can hide the other."""
    hidden, batch, past = (512, 8, 256) if quick else (1024, 16, 1024)
    heads, kv_heads, head_dim = 16, 4, 64
    where = device.device
    x = torch.randn(64, hidden, dtype=dtype, device=where)
    w = torch.randn(hidden, 4 * hidden, dtype=dtype, device=where)

    def attention_on(on: torch.device, kind: torch.dtype) -> Callable[[], object]:
        layout = RaggedLayout.build([1] * batch, [past] * batch, on)
        q = torch.randn(batch, heads, head_dim, dtype=kind, device=on)
        k, v = (torch.randn(batch, kv_heads, head_dim, dtype=kind, device=on) for _ in "kv")
        past_k = torch.randn(batch * past, kv_heads, head_dim, dtype=kind, device=on)
        past_v = torch.randn_like(past_k)
        return partial(ragged_attention, q, k, v, past_k, past_v, layout)

    on_device = attention_on(where, dtype)
    on_cpu = attention_on(torch.device("cpu"), torch.float32)
    reps = max(
        1, min(64, round(best_seconds(on_device, device) / best_seconds(lambda: x @ w, device)))
    )

    def dense() -> None:
        for _ in range(reps):
            x @ w

    pool = ThreadPoolExecutor(1, thread_name_prefix="nanoflex-profile")
    try:
        if device.is_cuda:
            side = torch.cuda.Stream(where)

            def both_on_device() -> None:
                side.wait_stream(torch.cuda.current_stream(where))
                with torch.cuda.stream(side):
                    on_device()
                dense()
                torch.cuda.current_stream(where).wait_stream(side)

        else:

            def both_on_device() -> None:
                running = pool.submit(on_device)
                dense()
                running.result()

        def beside_cpu_attention() -> None:
            running = pool.submit(on_cpu)
            dense()
            running.result()

        share_device = _overlap_share(dense, on_device, both_on_device, device)
        share_host = _overlap_share(dense, on_cpu, beside_cpu_attention, device)
    finally:
        pool.shutdown()
    return share_device, share_host


def nano_batch_overhead(device_name: str, probe: Probe, rows: int = 4) -> float:
    """Seconds each nano-batch beyond the first adds to a decoder layer: a step of `rows`
    one-token sequences of the demo model cut into `rows` nano-batches (overlapped, as the
    engine runs them) against the same step whole, per layer and extra piece. Their matmuls
    are tiny, so the difference is the fixed cost of a piece: launches and hand-offs."""
    seconds: dict[int, float] = {}
    num_layers = 1
    for num_nano in (1, rows):
        policy = Policy(gpu_batch_size=rows, num_nano_batches=num_nano)
        executor = Executor(EngineArgs(model=DEMO_MODEL, device=device_name), policy)
        try:
            num_layers = executor.config.num_layers
            steps = _OneTokenSteps(executor, rows)
            seconds[num_nano] = probe.seconds("nano_batch_overhead_s", steps, executor.device)
        finally:
            executor.close()
    return max(0.0, (seconds[rows] - seconds[1]) / (rows - 1) / num_layers)


class _OneTokenSteps:
    """Each call runs one engine step of `rows` new one-token sequences (freeing the last)."""

    def __init__(self, executor: Executor, rows: int) -> None:
        self.executor, self.rows = executor, rows
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0)
        self.seq_ids = itertools.count()
        self.running: list[int] = []

    def __call__(self) -> None:
        new = [next(self.seq_ids) for _ in range(self.rows)]
        chunks = [
            SeqChunk(seq, [5], 0, 0, [("gpu", page)], "gpu", "gpu", False, sampling=self.sampling)
            for page, seq in enumerate(new)
        ]
        self.executor.execute(StepPlan(new[0], chunks, freed_seq_ids=self.running))
        self.running = new
