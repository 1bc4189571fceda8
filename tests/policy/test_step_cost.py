"""The cost model charges a step's fixed cost once per step: a resident block's prompts run
in many chunked steps (policy/steps.py), each paying the profile's host time per layer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from policy.catalog import BUILTIN_MODELS
from policy.cost_model import estimate
from policy.hardware import HardwareSpec
from policy.policy import Policy
from policy.specs import WorkloadSpec
from policy.steps import RESIDENT_STEP_TOKENS, prefill_steps

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
LLAMA_3_8B = BUILTIN_MODELS["llama-3-8b"]
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)


def sitting(name: str) -> tuple[HardwareSpec, Policy, dict[str, float]]:
    """A GPU sitting's hardware profile, the resident policy it ran and what it measured."""
    record = json.loads((RESULTS / name).read_text())
    run = record["runs"]["nanoflex:auto"]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in run["policy"].items()}
    return HardwareSpec.from_dict(record["hardware"]), Policy(**fields), run["metrics"]


def test_a_resident_block_prefills_in_chunked_steps_and_pays_each() -> None:
    resident = Policy(gpu_batch_size=1024)
    assert prefill_steps(resident, 512) == 1024 * 512 // RESIDENT_STEP_TOKENS
    offloaded = Policy(gpu_batch_size=1024, weights_frac=(0.5, 0.5, 0.0))
    assert prefill_steps(offloaded, 512) == 1
    hardware, _, _ = sitting("gpu-llama-3-8b-p512-full-1128.json")
    free = dataclasses.replace(hardware, layer_overhead_s=0.0)
    slow = dataclasses.replace(hardware, layer_overhead_s=1e-3)
    for policy, steps in ((resident, 256), (offloaded, 1)):
        gap = (
            estimate(policy, LLAMA_3_8B, WORKLOAD, slow).prefill_time
            - estimate(policy, LLAMA_3_8B, WORKLOAD, free).prefill_time
        )
        assert gap == pytest.approx(steps * 1e-3, rel=1e-6), policy
        # a decode step is one step: its fixed cost is charged once at most, as before (part
        # of it hides behind attention's copies in the overlapped stage)
        decode_gap = (
            estimate(policy, LLAMA_3_8B, WORKLOAD, slow).decode_time
            - estimate(policy, LLAMA_3_8B, WORKLOAD, free).decode_time
        )
        assert 0.0 < decode_gap <= 1e-3 * (1 + 1e-6)


def test_the_resident_plan_predicts_the_h200_within_a_quarter() -> None:
    """Llama-3-8B 512 + 32 resident on the whole H200 (the 2026-11-28 profile and policy):
    prefill against the 19,724 tokens/s the first sitting measured (9314da5; the second,
    at f395f31, measured 11,819 with prefill steps 65 ms slower, a regression the model is not
    meant to follow: docs/benchmarks.md, "The prefill step between two sittings"), decode
    against the second's 7,735. Without the per-step cost the prefill prediction was 33,114
    tokens/s, 68% over."""
    hardware, policy, second = sitting("gpu-llama-3-8b-p512-full-1128.json")
    _, _, first = sitting("gpu-llama-3-8b-p512-full.json")
    predicted = estimate(policy, LLAMA_3_8B, WORKLOAD, hardware)
    assert predicted.prefill_throughput == pytest.approx(first["prefill_throughput"], rel=0.25)
    assert predicted.decode_throughput == pytest.approx(second["decode_throughput"], rel=0.25)
    free = estimate(policy, LLAMA_3_8B, WORKLOAD, dataclasses.replace(hardware, layer_overhead_s=0))
    assert free.prefill_throughput > 1.25 * first["prefill_throughput"]
