"""Policy search: enumerate the discrete choices, solve the placement LP for each (cvxpy).

For each (gpu_batch_size, num_gpu_batches, num_nano_batches, compress_weights, compress_kv,
cpu_attention, for MoE models cpu_experts, for vision models the tower's tier) the twelve
fractions (wg, wc, wd, cg, cc, cd, hg, hc, hd, eg, ec, ed) are the LP's variables; the max
over overlapped tasks (and over the rows of an overlapped compute task) is linearized with
epigraph variables t_pre and t_gen.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from base.errors import UserError
from policy.affine import NUM_TRIPLES, VARS
from policy.cost_model import (
    TASKS,
    CostTerms,
    Estimate,
    build_terms,
    estimate,
    evaluate,
    hardware_budgets,
)
from policy.hardware import HardwareSpec
from policy.moe import cpu_expert_break_even
from policy.nano_batching import MAX_COMPUTE_ROWS
from policy.policy import NUM_NANO_BATCHES, VISION_TIERS, Policy
from policy.specs import ModelSpec, WorkloadSpec
from policy.threads import max_compute_threads, plan_threads
from policy.units import format_bytes

GPU_BATCH_SIZES: tuple[int, ...] = (
    1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024,
)  # fmt: skip
NUM_GPU_BATCHES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)
COMPRESSION_MIN_GAIN = 0.02
"""4-bit compression costs some accuracy: it must win by 2% per compressed tensor kind."""
NANO_MIN_GAIN = 0.02
"""Nano-batching must win by 2%: its overlap is measured on two operations in isolation,
and the rest of a step (loads, stores, Python) competes with it in a real run."""
MIN_GAIN = 1e-3
"""A candidate must beat the best so far by this much: ties go to simpler, smaller blocks."""
TIE_BREAK_WEIGHT = 1e-3
"""Weight of the sum-of-tasks tie-breaker relative to the objective T / bls."""
MEMORY_ROWS: tuple[str, ...] = ("gpu_prefill", "gpu_decode", "cpu_prefill", "cpu_decode", "disk")
STAGE_ROWS = len(TASKS) - 1 + MAX_COMPUTE_ROWS
"""Epigraph rows per stage: one per copy task, up to MAX_COMPUTE_ROWS for compute."""


class PolicyInfeasible(UserError):
    """No policy fits the memory budgets; the message says what does not fit, by how much."""


@dataclass(frozen=True)
class PlanResult:
    """The chosen policy, its predicted throughputs (tokens/s) and what limits it."""

    policy: Policy
    predicted: dict[str, float]
    """prefill_throughput, decode_throughput, generation_throughput (FlexGen's definitions,
    docs/benchmarks.md, Metrics)."""
    bottleneck: str
    """'<stage>:<task>' of the binding term (e.g. 'decode:ctog'), plus full memory tiers."""
    estimate: Estimate
    alternatives: dict[str, float]
    """Best generation throughput per (compress_weights, compress_kv, cpu_attention) combo."""
    nano_estimates: dict[int, Estimate]
    """The chosen policy's prediction with each possible num_nano_batches (same placement)."""
    runners_up: tuple[tuple[Policy, float], ...] = ()
    """The best policy of each other design (compression, CPU attention, CPU experts,
    nano-batches) with its predicted generation throughput, best first, thread counts not
    yet planned (`policy.threads.plan_threads`): what a plan check
    (engine/core/plan_check.py) runs against the chosen one when they are close."""
    num_solved: int = 0
    """LPs solved during the search."""
    expert_break_even: int = 0
    """MoE models: `policy.moe.cpu_expert_break_even` at the CPU threads the search priced
    CPU compute with (max_compute_threads) and the plan's weight format; 0 for dense ones."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_dict(),
            "predicted": dict(self.predicted),
            "bottleneck": self.bottleneck,
        }


class PlacementLP:
    """One parametrized LP (DPP: compiled once, re-solved with new coefficients). cvxpy is
    imported here, when a search builds its LP, not with this module: a search remembered on
    disk (policy/search_cache.py) is read back without it (an import of seconds)."""

    def __init__(self) -> None:
        import cvxpy as cp

        num_vars, num_tasks, num_rows = len(VARS), STAGE_ROWS, len(MEMORY_ROWS)
        self.x = cp.Variable(num_vars, nonneg=True)
        t_pre, t_gen = cp.Variable(), cp.Variable()
        self.a_pre = cp.Parameter((num_tasks, num_vars))
        self.b_pre = cp.Parameter(num_tasks)
        self.a_gen = cp.Parameter((num_tasks, num_vars))
        self.b_gen = cp.Parameter(num_tasks)
        self.a_mem = cp.Parameter((num_rows, num_vars))
        self.b_mem = cp.Parameter(num_rows)
        self.wg_floor = cp.Parameter(nonneg=True)
        constraints = [
            self.x[0] >= self.wg_floor,  # 1: the weights stay on the device (resident steps)
            t_pre >= self.a_pre @ self.x + self.b_pre,
            t_gen >= self.a_gen @ self.x + self.b_gen,
            self.a_mem @ self.x <= self.b_mem,
            cp.sum(self.x[0:3]) == 1,  # wg + wc + wd
            cp.sum(self.x[3:6]) == 1,  # cg + cc + cd
            cp.sum(self.x[6:9]) == 1,  # hg + hc + hd
            cp.sum(self.x[9:12]) == 1,  # eg + ec + ed
        ]
        # Tie-break among equally fast placements (FlexGen A.3's regularization): a tiny
        # weight on the *sum* of all tasks prefers placements that move fewer bytes.
        self.c_sum = cp.Parameter(num_vars)
        objective = t_pre + t_gen + TIE_BREAK_WEIGHT * (self.c_sum @ self.x)
        self.problem = cp.Problem(cp.Minimize(objective), constraints)

    def solve(self, terms: CostTerms) -> np.ndarray | None:
        """Fractions minimizing T / bls, or None when no placement fits."""
        import cvxpy as cp

        # Seconds per token, in units of its lower bound: the objective is O(1), so the solver's
        # tolerances (1e-8) are far below the tie-breaker's effect.
        scale = terms.num_layers / (terms.block_size * terms.gen_len) * _upper_bound(terms)
        c_sum = np.zeros(len(VARS))
        for a, b, stage, weight in (
            (self.a_pre, self.b_pre, terms.prefill, scale),
            (self.a_gen, self.b_gen, terms.decode, scale * (terms.gen_len - 1)),
        ):
            c_sum += sum(stage[t].rows[0].coeffs for t in TASKS) * weight
            rows = terms.stage_rows(stage)
            rows += [rows[-1]] * (STAGE_ROWS - len(rows))  # repeated rows bind nothing new
            a.value = np.array([r.coeffs for r in rows]) * weight
            b.value = np.array([r.const for r in rows]) * weight
        self.c_sum.value = c_sum
        self.wg_floor.value = 1.0 if terms.resident else 0.0
        rows = [terms.memory[r] for r in MEMORY_ROWS]
        # Normalize each memory row so its numbers are O(1) whatever the byte sizes.
        norms = np.array(
            [max(terms.capacity[r], np.abs(m.coeffs).max(), abs(m.const), 1.0)
             for r, m in zip(MEMORY_ROWS, rows)]
        )  # fmt: skip
        self.a_mem.value = np.array([m.coeffs for m in rows]) / norms[:, None]
        self.b_mem.value = (
            np.array([terms.capacity[r] - m.const for r, m in zip(MEMORY_ROWS, rows)]) / norms
        )
        for solver in (cp.CLARABEL, cp.HIGHS):
            try:
                self.problem.solve(solver=solver)
            except cp.error.SolverError:
                continue
            if self.problem.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
                return None
            if self.problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
                assert self.x.value is not None
                return np.asarray(self.x.value, dtype=float)
        return None


def _normalized(x: np.ndarray) -> np.ndarray:
    """Clip solver noise below 0 and make each triple sum to 1."""
    triples = np.clip(x, 0.0, None).reshape(NUM_TRIPLES, 3)
    return (triples / triples.sum(axis=1, keepdims=True)).reshape(-1)


def _tidy(x: np.ndarray, snap: bool) -> np.ndarray:
    """Fractions with 4 decimals: gpu and cpu rounded down, the rest on disk, so the two
    faster tiers never gain bytes. With `snap`, slivers under 0.1% first move to the
    triple's largest entry."""
    triples = _normalized(x).reshape(NUM_TRIPLES, 3)
    tidy = np.zeros_like(triples)
    for row, triple in enumerate(triples):
        if snap:
            largest = int(np.argmax(triple))
            triple = np.where(triple < 1e-3, 0.0, triple)
            triple[largest] += 1.0 - triple.sum()
        gpu, cpu = np.floor(triple[:2] * 1e4 + 1e-6) / 1e4
        tidy[row] = (gpu, cpu, max(0.0, round(1.0 - gpu - cpu, 4)))
    return tidy.reshape(-1)


def _with_fractions(choice: Policy, x: np.ndarray) -> Policy:
    return dataclasses.replace(
        choice,
        weights_frac=(float(x[0]), float(x[1]), float(x[2])),
        kv_frac=(float(x[3]), float(x[4]), float(x[5])),
        act_frac=(float(x[6]), float(x[7]), float(x[8])),
        experts_frac=(float(x[9]), float(x[10]), float(x[11])),
    )


def search(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    *,
    gpu_mem: int | None = None,
    cpu_mem: int | None = None,
    disk_mem: int | None = None,
    allow_compression: bool = True,
    allow_cpu_attention: bool = True,
) -> PlanResult:
    """The policy with the highest predicted generation throughput that fits the budgets.

    Budgets default to the hardware's memory sizes. Raises `PolicyInfeasible`.
    """
    budgets = hardware_budgets(hardware, gpu_mem, cpu_mem, disk_mem)
    lp = PlacementLP()
    best: tuple[float, Policy, Estimate] | None = None  # (score, policy, estimate)
    alternatives: dict[str, float] = {}
    designs: dict[tuple[bool | int | str, ...], tuple[float, Policy]] = {}  # each design's best
    num_solved = 0
    flag_values = (False, True) if allow_compression else (False,)
    attention_values = (False, True) if allow_cpu_attention else (False,)
    # Without a measured overlap nano-batching only adds cost (policy/nano_batching.py): the
    # search then tries one nano-batch only, which is exact, not a shortcut.
    overlaps = hardware.nano_overlap_device_estimate or hardware.nano_overlap_host_estimate
    nano_counts = NUM_NANO_BATCHES if overlaps else (1,)
    expert_values = (False, True) if model.is_moe else (False,)
    # A vision model's tower on the GPU first: the CPU's must win (it frees the GPU's share).
    tiers = VISION_TIERS if model.vision is not None else ("gpu",)
    # The engine's steps differ with the weights' home (policy/steps.py: resident weights run
    # prompts in chunks, offloaded ones the block's prompts at once) and so do its reserves:
    # each is its own design, its LP held to its side (`CostTerms.resident`).
    for (
        compress_weights,
        compress_kv,
        cpu_attention,
        cpu_experts,
        vision_tier,
        resident,
    ) in itertools.product(
        flag_values, flag_values, attention_values, expert_values, tiers, (True, False)
    ):
        penalty = 1 + COMPRESSION_MIN_GAIN * (compress_weights + compress_kv)
        combo = f"compress_weights={compress_weights} compress_kv={compress_kv} " + (
            f"cpu_attention={cpu_attention}"
        )
        if model.is_moe:
            combo += f" cpu_experts={cpu_experts}"
        if model.vision is not None:
            combo += f" vision_tier={vision_tier}"
        for num_gpu_batches in NUM_GPU_BATCHES:
            fitted_any = False
            for gpu_batch_size in GPU_BATCH_SIZES:
                fits = True
                for num_nano in nano_counts:
                    if num_nano > gpu_batch_size:
                        break
                    choice = Policy(
                        gpu_batch_size=gpu_batch_size,
                        num_gpu_batches=num_gpu_batches,
                        num_nano_batches=num_nano,
                        cpu_attention=cpu_attention,
                        compress_weights=compress_weights,
                        compress_kv=compress_kv,
                        cpu_experts=cpu_experts,
                        vision_tier=vision_tier,
                        num_cpu_threads=max_compute_threads(hardware),
                        weights_frac=(1.0, 0.0, 0.0) if resident else (0.0, 1.0, 0.0),
                    )
                    nano_penalty = penalty + NANO_MIN_GAIN * (num_nano > 1)
                    terms = build_terms(model, workload, hardware, choice, budgets)
                    if best is not None and _upper_bound(terms) / nano_penalty <= best[0]:
                        fitted_any = True  # cannot win, but larger batches still might
                        continue
                    x = lp.solve(terms)
                    num_solved += 1
                    if x is None:
                        fits = False  # memory does not depend on the nano-batches
                        break
                    if not model.is_moe:  # no routed experts: their triple means nothing
                        x[9:12] = (1.0, 0.0, 0.0)
                    fitted_any = True
                    policy, result = _finish(choice, x, terms)
                    throughput = result.generation_throughput
                    alternatives[combo] = max(alternatives.get(combo, 0.0), throughput)
                    flags = (compress_weights, compress_kv, cpu_attention, cpu_experts)
                    design: tuple[bool | int | str, ...] = (*flags, num_nano, vision_tier)
                    if throughput > designs.get(design, (0.0, policy))[0]:
                        designs[design] = (throughput, policy)
                    if best is None or throughput / nano_penalty > best[0] * (1 + MIN_GAIN):
                        best = (throughput / nano_penalty, policy, result)
                if not fits:
                    break  # more sequences only need more memory
            if not fitted_any:
                break  # even the smallest batch does not fit with more GPU batches
    if best is None:
        raise PolicyInfeasible(_diagnose(model, workload, hardware, budgets, allow_compression))
    _, policy, _ = best
    policy = plan_threads(model, workload, hardware, policy)
    final = estimate(policy, model, workload, hardware, budgets)
    nano_estimates = {
        n: estimate(
            dataclasses.replace(policy, num_nano_batches=n), model, workload, hardware, budgets
        )
        for n in NUM_NANO_BATCHES
        if n <= policy.gpu_batch_size
    }
    chosen = (
        policy.compress_weights,
        policy.compress_kv,
        policy.cpu_attention,
        policy.cpu_experts,
        policy.num_nano_batches,
        policy.vision_tier,
    )
    runners_up = tuple(
        (other, throughput)
        for design, (throughput, other) in sorted(designs.items(), key=lambda kv: -kv[1][0])
        if design != chosen
    )
    return PlanResult(
        policy=policy,
        predicted=final.predicted(),
        bottleneck=_bottleneck(final),
        estimate=final,
        alternatives=alternatives,
        nano_estimates=nano_estimates,
        runners_up=runners_up,
        num_solved=num_solved,
        expert_break_even=cpu_expert_break_even(
            model, hardware, max_compute_threads(hardware), policy.compress_weights
        ),
    )


def _upper_bound(terms: CostTerms) -> float:
    """Generation throughput no placement can beat: each task at its simplex minimum."""
    pre = [terms.prefill[t].minimum() for t in TASKS]  # lower bounds of each task
    gen = [terms.decode[t].minimum() for t in TASKS]
    combine = max if terms.overlap else sum
    seconds = terms.num_layers * (combine(pre) + (terms.gen_len - 1) * combine(gen))
    return terms.block_size * terms.gen_len / seconds


def _finish(choice: Policy, x: np.ndarray, terms: CostTerms) -> tuple[Policy, Estimate]:
    """Tidy the LP's fractions where that still fits and costs under 0.1% throughput;
    otherwise keep them as solved."""
    exact = _normalized(x)
    reference = evaluate(terms, exact).generation_throughput
    for candidate in (_tidy(x, snap=True), _tidy(x, snap=False)):
        result = evaluate(terms, candidate)
        if result.fits and result.generation_throughput >= reference * 0.999:
            return _with_fractions(choice, candidate), result
    return _with_fractions(choice, exact), evaluate(terms, exact)


def _bottleneck(result: Estimate) -> str:
    full = [
        tier
        for tier in ("gpu", "cpu", "disk")
        if result.capacity_bytes[tier] > 0
        and result.peak_bytes[tier] >= 0.995 * result.capacity_bytes[tier]
    ]
    if not full:
        return result.bottleneck
    return f"{result.bottleneck} ({', '.join(full)} memory full)"


def _diagnose(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    budgets: dict[str, float],
    allow_compression: bool,
) -> str:
    """Explain why even one sequence (gbs=1, nb=1, smallest formats) does not fit."""
    choice = Policy(
        gpu_batch_size=1,
        num_gpu_batches=1,
        cpu_attention=True,
        compress_weights=allow_compression,
        compress_kv=allow_compression,
        vision_tier="gpu" if model.vision is None else "cpu",  # the tower off the GPU
    )
    terms = build_terms(model, workload, hardware, choice, budgets)
    name = model.name
    for tier, flag in (("gpu", "--gpu-mem"), ("cpu", "--cpu-mem")):
        for row in (f"{tier}_prefill", f"{tier}_decode"):
            floor, usable = terms.memory[row].minimum(), terms.capacity[row]
            if floor > usable:
                return (
                    f"{name} needs at least {format_bytes(floor)} of {tier} working memory "
                    f"for one sequence ({row.split('_')[1]}: a layer's weights, buffers, "
                    f"activations) but {flag} leaves {format_bytes(usable)} usable; short by "
                    f"{format_bytes(floor - usable)}"
                )
    # Everything homed somewhere: the three tiers together must hold weights + KV + activations.
    tiers = ("gpu_decode", "cpu_decode", "disk")
    homed = (terms.memory[tiers[0]] + terms.memory[tiers[1]] + terms.memory[tiers[2]]).minimum()
    usable_total = sum(terms.capacity[r] for r in tiers)
    if homed > usable_total:
        return (
            f"{name} needs at least {format_bytes(homed)} across gpu+cpu+disk "
            f"(weights {format_bytes(model.total_weight_bytes)} before compression) but the "
            f"budgets leave {format_bytes(usable_total)} usable; short by "
            f"{format_bytes(homed - usable_total)} (raise --cpu-mem or --disk-mem)"
        )
    usable_text = ", ".join(
        f"{tier} {format_bytes(terms.capacity[row])}"
        for tier, row in (("gpu", "gpu_decode"), ("cpu", "cpu_decode"), ("disk", "disk"))
    )
    return (
        f"no placement of {name} fits the budgets (usable {usable_text}): the home tiers and "
        "the staging buffers that tensors on slower tiers need do not fit together; "
        "raise --cpu-mem or --gpu-mem"
    )
