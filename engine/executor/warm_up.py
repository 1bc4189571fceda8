"""`warm_up`: a CUDA engine's graphs captured and Triton kernels compiled before the first request.

A CUDA graph captured, or a Triton specialization compiled, the first time a step needs it
costs that step milliseconds to seconds: inside a timed run, or a user's first requests. So
the engine, once its weights are placed and before it says it is ready, makes them all:

- **Graphs**: for every GPU batch, every row count a decode-only step can give it
  (`decode_rows`: the scheduler's discrete sizes, with its padding rule), captured through
  `GraphRunner.capture`, and for a plan of one GPU batch every discrete size up to
  `PIECEWISE_MAX_ROWS` (policy/reserves.py, which prices their memory), which mixed and
  prefill steps replay (piecewise: attention eager between the graphs; `piecewise=False`,
  `--no-piecewise-graphs`, leaves them eager), the most rows first: all captures share one
  memory pool and each later one fits in the blocks the first freed (vLLM's order), so the
  pool holds one capture's transient buffers, not one per row count. Nano-batches' graphs
  are not among them: their row counts follow each step's balance of attention work, not
  the discrete sizes, and are captured at first use.
- **Kernels**: a few steps on dummy sequences through `Executor.execute`, the path real
  steps take, so every launch meets the specialization a real step would (the paged kernel's
  prefill and decode tiles, one split and several with their merge, each layer's window and
  sinks; the fused norm, rotary and SiLU kernels): a prefill long enough for a split
  decode (in chunks within the step's tokens), its decode (several splits), a mixed step,
  and a decode of sequences with a short past (one split) beside a one-token prompt, then
  of one alone (with nano-batches, a batch of one sequence runs whole). The paged kernel
  leaves what changes from step to step unspecialized (`triton_paged.VARYING`), so no later
  step meets a new specialization.

The dummy sequences use pages of a private page table on the gpu (or cpu) tier, freed after,
before the scheduler hands out any; a placement whose KV or activations live on disk, or a
hybrid model (its state slots), runs no warm-up steps. `EngineArgs.warmup=False`
(`--no-warmup`) skips it all; the `WarmUp` record (in `EngineInfo`, and logged) says how long
it took and what it made. tests/engine/test_warm_up.py checks on the rehearsal's fake
CUDA device that no capture and no compile happens after it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from base.pages import PAGE_TOKENS
from engine.core.kv_pages import PageManager
from engine.core.protocol import SeqChunk, StepPlan, StepResult, WarmUp
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_config import pick_size
from engine.executor.pipeline import BlockPipeline
from engine.kernels.triton_attention import DECODE_BLOCK_N
from engine.kernels.triton_launch import compiled_count
from engine.storage.device import Device
from policy import Policy
from policy.reserves import PIECEWISE_MAX_ROWS


class Executor(Protocol):
    """What the warm-up uses of `engine.executor.executor.Executor`."""

    policy: Policy
    pipeline: BlockPipeline
    device: Device
    states: Any
    step_tokens: int

    def execute(self, plan: StepPlan) -> StepResult: ...


LONG_PROMPT = DECODE_BLOCK_N + 1
"""A dummy prompt's tokens: more than one decode key tile, so its decode splits its keys."""
FIRST_SEQ_ID = -(1 << 40)
"""Dummy sequences count up from here: never the scheduler's ids (>= 0) nor `score`'s."""


def decode_rows(
    batch_sizes: tuple[int, ...] | None, gpu_batch_size: int, num_gpu_batches: int
) -> dict[int, list[int]]:
    """Per GPU batch, every row count a decode-only step can give it. A step runs s_k decodes
    in batch k (0 <= s_k <= gpu_batch_size, t = sum of them >= 1) and pads its last batch with
    a nonempty step to `pick_size(t)` rows (`Executor._run`); batch_sizes None: no discrete
    batching, no padding. A batch before the step's last has s_k rows, any of 1..size if a
    later batch exists; the last has s_k + pick_size(t) - t, with t - s_k the earlier
    batches' decodes, 0..k * gpu_batch_size."""
    out: dict[int, list[int]] = {}
    for k in range(num_gpu_batches):
        rows = set(range(1, gpu_batch_size + 1)) if k < num_gpu_batches - 1 else set()
        for s in range(1, gpu_batch_size + 1):
            for t in range(s, s + k * gpu_batch_size + 1):
                rows.add(s if batch_sizes is None else s + pick_size(batch_sizes, t) - t)
        out[k] = sorted(rows)
    return out


def warm_up(
    executor: Executor, batch_sizes: tuple[int, ...] | None, piecewise: bool = True
) -> WarmUp:
    """Capture `executor`'s decode graphs (and with `piecewise`, its mixed and prefill
    steps' graphs) and compile its kernels (see the module): the scheduler's discrete sizes
    `batch_sizes` (None: no discrete batching)."""
    start = time.perf_counter()
    runner = executor.pipeline.graphs
    captured = 0 if runner is None else runner.num_captures
    compiled = compiled_count()
    policy = executor.policy
    if runner is not None:
        rows_by_batch = decode_rows(batch_sizes, policy.gpu_batch_size, policy.num_gpu_batches)
        if piecewise and batch_sizes is not None and policy.num_gpu_batches == 1:
            runner.dense_sizes = frozenset(s for s in batch_sizes if s <= PIECEWISE_MAX_ROWS)
            rows_by_batch[0] = sorted(set(rows_by_batch[0]) | runner.dense_sizes)
        for k, counts in rows_by_batch.items():
            for rows in reversed(counts):  # the most first: the rest reuse its pool's blocks
                runner.capture(k, rows)
    num_steps = _run_steps(executor, batch_sizes or (policy.block_size,))
    executor.device.synchronize()
    done = WarmUp(
        seconds=round(time.perf_counter() - start, 3),
        graphs_captured=0 if runner is None else runner.num_captures - captured,
        kernels_compiled=compiled_count() - compiled,
        num_steps=num_steps,
    )
    logging.getLogger("nanoflex.engine").info(
        "warm-up: %d CUDA graphs captured, %d Triton specializations compiled, %d steps, %.1f s",
        done.graphs_captured,
        done.kernels_compiled,
        done.num_steps,
        done.seconds,
    )
    return done


def _tier(fracs: tuple[float, float, float]) -> str | None:
    """The tier the dummy sequences use: the gpu's if it homes any, else the cpu's; None
    where only the disk does (its pages may hold a previous run's cached KV)."""
    return "gpu" if fracs[0] > 0 else "cpu" if fracs[1] > 0 else None


def _run_steps(executor: Executor, batch_sizes: tuple[int, ...]) -> int:
    """The dummy steps (see the module); how many ran."""
    policy = executor.policy
    kv_tier, act_tier = _tier(policy.kv_frac), _tier(policy.act_frac)
    if kv_tier is None or act_tier is None or executor.states is not None:
        return 0
    pages = PageManager(PAGE_TOKENS, {})
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    started: set[int] = set()
    lengths: dict[int, int] = {}

    def chunk(seq_id: int, num_tokens: int) -> SeqChunk:
        start = lengths.get(seq_id, 0)
        lengths[seq_id] = start + num_tokens
        first = seq_id not in started
        started.add(seq_id)
        return SeqChunk(
            seq_id,
            [1] * num_tokens,
            start,
            0,
            pages.append(seq_id, num_tokens, kv_tier),
            kv_tier,
            act_tier,
            do_sample=True,
            sampling=greedy if first else None,
        )

    a, b, c, d = (FIRST_SEQ_ID + i for i in range(4))
    most = max(1, executor.step_tokens - 1)  # a step's tokens, as the scheduler's budget
    steps = [[chunk(a, min(most, LONG_PROMPT - n))] for n in range(0, LONG_PROMPT, most)]
    steps += [
        [chunk(a, 1)],  # decode, keys in several splits
        [chunk(a, 1), chunk(b, 3), chunk(c, 2)],  # mixed
        [chunk(b, 1), chunk(c, 1), chunk(d, 1)],  # decode over a short past (one split), and
        [chunk(b, 1)],  # a one-token prompt; alone (a batch of one is never cut in nano-batches)
    ]
    for i, chunks in enumerate(steps):
        plan = StepPlan(FIRST_SEQ_ID + i, chunks)
        plan.dense_size = pick_size(batch_sizes, plan.num_tokens)
        executor.execute(plan)
    executor.execute(StepPlan(FIRST_SEQ_ID + len(steps), [], freed_seq_ids=sorted(started)))
    return len(steps)
