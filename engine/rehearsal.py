"""`rehearse`: the engine's CUDA path for one plan, run without a GPU, every device byte counted.

The engine is built and run as on a CUDA device (`device="cuda"`: the budgets, weight homes
and slots, KV pools, stores, staging, graphs and sampler a GPU gets), under `fake_cuda`
(engine/fake_cuda.py): tensors hold no data, so OPT-30B's weights cost nothing here,
and `DeviceLedger` counts what would live on the device. The workload is the plan's: a block
of `prompt_len`-token prompts generating `gen_len` tokens each, through the real scheduler.
The record says whether the peak stayed within the cap and where it happened (step, task,
layer, which buffers).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from engine.storage.device_ledger import DeviceLedger
from policy import Policy


@dataclass(frozen=True)
class Rehearsal:
    """What one rehearsal found."""

    device_peak_bytes: int
    """The most bytes alive on the device at once, setup and steps."""
    gpu_mem_bytes: int
    """The cap (`--gpu-mem`)."""
    peak: dict[str, Any]
    """Where: step, task, layer, gpu_batch, buffers (live bytes by what made them)."""
    steps: list[dict[str, Any]]
    """Per step: its name and the most bytes alive during it."""
    kv_capacity_pages: dict[str, int | None]
    """The KV pages the engine gave each tier after its reserves."""
    label_peaks: dict[str, int]
    """The most bytes alive at once by what made them (weights, kv pool, load_cache...)."""
    side_stream_peak: int
    """The most bytes alive at once only because a side stream may still read them (stores
    in flight to host memory)."""
    seconds: float
    gpu_reserve_bytes: int = 0
    """What the engine kept out of the gpu tier's KV pages for a step: the planner's reserves
    (policy/reserves.py)."""
    kv_page_bytes: int = 0
    """One KV page's bytes over all layers."""
    gpu_weight_bytes: int = 0
    """The weights the engine homed on the device."""
    error: str | None = None
    """The engine's own refusal (a budget error), if it refused to run."""
    loops_run: int = 0
    """Steps whose layer loop ran (`decode_stride`: engine/stand_in_steps.py)."""
    stood_in: int = 0
    """Decode steps whose layer loop was stood in for, each bounded by a later like one."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.device_peak_bytes <= self.gpu_mem_bytes


class LedgerTracer:
    """The pipeline's tracer interface, attributing what each task allocates (the ledger's
    labels are the trace's task names: load_weight, compute, store_cache, ...)."""

    def __init__(self, ledger: DeviceLedger) -> None:
        self.ledger = ledger

    def span(
        self,
        name: str,
        cat: str,
        layer: int,
        gpu_batch: int = 0,
        nano_batch: int = 0,
        host: bool = False,
        expert: int | None = None,
    ) -> Any:
        return self.ledger.task(name, layer, gpu_batch)


def _labelled(ledger: DeviceLedger, label: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with ledger.task(label):
            return method(*args, **kwargs)

    return run


@contextmanager
def _setup_labels(ledger: DeviceLedger) -> Iterator[None]:
    """What the engine makes at start, by name: homed weights, the slots offloaded layers
    load into, a vision model's tower (where its tier is the device), KV pools (also grown
    in steps), the sampler's buffers."""
    from engine.executor.step_sampler import StepSampler
    from engine.executor.vision_encoder import VisionEncoder
    from engine.storage.kv_store import KVStore
    from engine.storage.weight_store import WeightStore

    labels = (
        (WeightStore, "read_all", "weights"),
        (VisionEncoder, "__init__", "vision tower"),
        (WeightStore, "make_slots", "weight slots"),
        (KVStore, "reserve", "kv pool"),
        (StepSampler, "sample", "sampler"),
    )
    with ExitStack() as stack:
        for owner, name, label in labels:  # a renamed method fails here, not silently
            method = getattr(owner, name)
            stack.enter_context(mock.patch.object(owner, name, _labelled(ledger, label, method)))
        yield


def _step_name(plan: Any, counts: dict[str, int]) -> str:
    kind = "prefill" if any(len(c.token_ids) > 1 for c in plan.chunks) else "decode"
    counts[kind] = counts.get(kind, 0) + 1
    return f"{kind} {counts[kind]}"


def distinct_prompts(count: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """`count` prompts of `prompt_len` tokens that share no KV page: each starts with its own
    token (the prefix cache would otherwise hold one prompt's pages for all of them, and the
    rehearsal counted OPT-6.7B's GPU KV pool at 512 MiB where the plan puts 5.6 GiB)."""
    first = 5
    return [[first + i % (vocab_size - first)] + [first] * (prompt_len - 1) for i in range(count)]


def rehearse(
    model_dir: Path,
    policy: Policy,
    *,
    gpu_mem: int,
    cpu_mem: int,
    disk_mem: int | None = None,
    prompt_len: int,
    gen_len: int,
    num_prompts: int | None = None,
    progress: bool = False,
    warmup: bool = True,
    decode_stride: int = 1,
) -> Rehearsal:
    """Run `num_prompts` (default: the policy's block) prompts of `prompt_len` tokens for
    `gen_len` tokens on a rehearsed CUDA device of `gpu_mem` bytes beside `cpu_mem` of RAM.
    The weights are generated from the directory's config (`dummy:`), whatever it holds.
    `warmup`: the engine's warm-up at start (engine/executor/warm_up.py: its graphs and
    dummy steps count in the setup's bytes), as `serve` runs it. `decode_stride`: the layer
    loop of every `decode_stride`-th decode step of a run of like ones runs, and of each
    sequence's last; the others' peaks are bounded by the next like loop run
    (engine/stand_in_steps.py; 1, the default: every loop runs)."""
    import warnings

    from engine.executor.budgets import MemoryBudgetError
    from engine.fake_cuda import fake_cuda
    from engine.loading.dummy import is_dummy
    from engine.loading.generated import local_model_dir
    from engine.stand_in_steps import StandIns
    from policy.specs import WorkloadSpec

    if not is_dummy(model_dir):
        model_dir = local_model_dir(f"dummy:{model_dir}")
    ledger = DeviceLedger()
    stand_ins = StandIns(ledger, decode_stride, last_position=prompt_len + gen_len - 2)
    steps: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    capacity: dict[str, int | None] = {}
    reserve = page_bytes = weights = 0
    error = None
    start = time.perf_counter()
    host = max(cpu_mem, 1 << 30) * 2  # the budgets' share of RAM is cpu_mem, as given
    with (
        warnings.catch_warnings(),
        fake_cuda(ledger, device_bytes=gpu_mem, host_bytes=host),
        _setup_labels(ledger),
    ):
        warnings.simplefilter("ignore")  # fake tensors' data pointers, read by layout checks
        from engine import LLM, SamplingParams

        try:
            llm = LLM(
                str(model_dir),
                policy=policy,
                device="cuda",
                gpu_mem=gpu_mem,
                cpu_mem=cpu_mem,
                disk_mem=disk_mem,
                workload=WorkloadSpec(prompt_len, gen_len),
                warmup=warmup,
            )
        except MemoryBudgetError as e:
            error = str(e)
        else:
            with llm:
                executor = llm.executor
                capacity = dict(executor.kv_capacity_pages())
                reserve, page_bytes = executor.gpu_reserve_bytes(), executor.kv.page_bytes
                weights = executor.weights.bytes_per_tier()["gpu"]
                tracer = LedgerTracer(ledger)
                executor.pipeline.tracer = tracer  # type: ignore[assignment]
                if executor.pipeline.nano is not None:
                    executor.pipeline.nano.tracer = tracer  # type: ignore[assignment]
                execute = executor.execute
                executor.pipeline.run = stand_ins.wrap(executor.pipeline.run)  # type: ignore[method-assign]

                def execute_counted(plan: Any) -> Any:
                    ledger.step = _step_name(plan, counts)
                    ledger.step_peak = ledger.live_bytes
                    stand_ins.begin(ledger.step, plan)
                    out = execute(plan)
                    steps.append({"step": ledger.step, "peak_bytes": ledger.step_peak})
                    if progress:
                        elapsed = time.perf_counter() - start
                        print(
                            f"rehearsal: {ledger.step} peak {ledger.step_peak / 2**30:.2f} GiB "
                            f"({elapsed:.0f} s)",
                            file=sys.stderr,
                        )
                    return out

                executor.execute = execute_counted  # type: ignore[method-assign]
                params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
                count = num_prompts or policy.block_size
                llm.generate(
                    distinct_prompts(count, prompt_len, executor.config.vocab_size), params
                )
    peak_bytes, peak = ledger.peak.nbytes, ledger.to_dict()
    bound = stand_ins.peak_bound
    if bound is not None and bound.bound is not None and bound.bound > peak_bytes:
        peak_bytes = bound.bound
        peak = {"step": bound.step, "task": "bound", "layer": None, "gpu_batch": None}
        peak |= {"bounded_by": bound.bounded_by, "buffers": {}}
    bounds = {s.step: (s.bound, s.bounded_by) for s in stand_ins.stood_in}
    loops = {loop.step: loop.start_bytes + loop.rise for loop in stand_ins.loops}
    for record in steps:
        if record["step"] in bounds:
            record["bound_bytes"], record["bounded_by"] = bounds[record["step"]]
        elif record["step"] in loops:
            record["loop_peak_bytes"] = loops[record["step"]]
    if stand_ins.unbounded and error is None:
        error = f"stood-in steps no later loop bounds: {', '.join(stand_ins.unbounded)}"
    return Rehearsal(
        device_peak_bytes=peak_bytes,
        gpu_mem_bytes=gpu_mem,
        peak=peak,
        steps=steps,
        kv_capacity_pages=capacity,
        label_peaks=dict(ledger.label_peaks),
        side_stream_peak=ledger.deferred_peak,
        seconds=time.perf_counter() - start,
        gpu_reserve_bytes=reserve,
        kv_page_bytes=page_bytes,
        gpu_weight_bytes=weights,
        error=error,
        loops_run=len(stand_ins.loops),
        stood_in=len(stand_ins.stood_in),
    )
