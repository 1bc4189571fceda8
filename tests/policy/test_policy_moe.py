"""The cost model and the LP know mixture-of-experts: distinct experts per block, expert bytes
loaded, FLOPs of the active experts only, GPU-resident experts, CPU expert compute."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from policy.catalog import BUILTIN_MODELS
from policy.cost_model import build_terms, estimate, hardware_budgets
from policy.moe import (
    cpu_expert_break_even,
    cpu_expert_seconds,
    expected_distinct_experts,
    expert_copy_seconds,
    experts_per_tier,
)
from policy.plan import format_report
from policy.policy import Policy
from policy.search import PlacementLP, search
from policy.specs import WorkloadSpec
from server.cli import main
from tests.policy.test_policy_nano import H100

GiB = 1024**3
REPO = Path(__file__).resolve().parents[2]
H100_PROFILE = REPO / "bench" / "results" / "hardware-h100.json"
MIXTRAL = BUILTIN_MODELS["mixtral-8x7b"]
QWEN3_MOE = BUILTIN_MODELS["qwen3-30b-a3b"]
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
# A roofline GPU box (no dense table): compute-bound expert GEMMs are priced by their FLOPs;
# its host memory is slower than PCIe, so CPU expert compute never pays.
GPU_BOX = dataclasses.replace(H100, cpu_mem_bw=20e9)
# KTransformers' kind of box: PCIe 3.0, many DDR5 channels, a 24 GiB card.
CPU_BOX = dataclasses.replace(
    GPU_BOX,
    gpu_mem_bytes=24 * GiB,
    cpu_mem_bytes=256 * GiB,
    ctog_bw=12e9,
    gtoc_bw=12e9,
    gpu_flops=150e12,
    gpu_mem_bw=900e9,
    cpu_flops=3e12,
    num_cpu_cores=32,
    cpu_mem_bw=200e9,
)
ON_GPU = Policy(gpu_batch_size=8, num_gpu_batches=1)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_tokens"),
    [(8, 2, 1), (8, 2, 3), (8, 2, 12), (64, 8, 4), (128, 8, 8), (128, 8, 40)],
)
def test_distinct_experts_match_a_monte_carlo_draw(
    num_experts: int, top_k: int, num_tokens: int
) -> None:
    """Each token routed to a uniformly random set of top_k experts: the mean number of
    distinct experts a block touches is E (1 - (1 - k/E)^T), within 4 standard errors."""
    rng = np.random.default_rng(28)
    draws = 2000
    scores = rng.random((draws, num_tokens, num_experts))
    picks = np.argsort(scores, axis=-1)[..., :top_k].reshape(draws, -1)  # k distinct per token
    touched = np.zeros((draws, num_experts), dtype=bool)
    touched[np.repeat(np.arange(draws), picks.shape[1]), picks.ravel()] = True
    distinct = touched.sum(axis=1)
    expected = expected_distinct_experts(num_experts, top_k, num_tokens)
    assert abs(distinct.mean() - expected) <= 4 * distinct.std() / np.sqrt(draws) + 1e-9
    assert expected_distinct_experts(num_experts, top_k, 1) == pytest.approx(top_k)


def test_flops_count_only_the_active_experts_and_bytes_every_expert() -> None:
    """Twice the experts at the same top-2: the prefill compute (FLOP-bound) stays, the weight
    bytes on the GPU grow by the 8 extra experts of each of the 32 layers."""
    wider = dataclasses.replace(MIXTRAL, num_experts=16)
    assert wider.active_params - MIXTRAL.active_params == 32 * 8 * 4096  # the router's rows
    assert wider.total_params - MIXTRAL.total_params == 32 * 8 * (MIXTRAL.expert_params + 4096)
    base = estimate(ON_GPU, MIXTRAL, WORKLOAD, GPU_BOX)
    more = estimate(ON_GPU, wider, WORKLOAD, GPU_BOX)
    assert more.prefill_terms["compute"] == pytest.approx(base.prefill_terms["compute"], rel=1e-3)
    extra = 32 * 8 * (MIXTRAL.expert_weight_bytes + 4096 * 2)
    assert more.peak_bytes["gpu"] - base.peak_bytes["gpu"] == pytest.approx(extra, rel=0.01)
    # Were every expert computed (a dense MLP of all 8 experts' width), prefill would cost 4x.
    dense = dataclasses.replace(
        MIXTRAL, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, moe_layer_ids=()
    )
    dense = dataclasses.replace(dense, intermediate_size=8 * 14336)
    all_experts = estimate(ON_GPU, dense, WORKLOAD, GPU_BOX).prefill_terms["compute"]
    assert all_experts > 3 * base.prefill_terms["compute"]


@pytest.mark.parametrize("block", [1, 4, 64])
def test_experts_loaded_per_block_are_the_distinct_ones_touched(block: int) -> None:
    """Experts homed on the CPU, everything else on the GPU: a decode step copies D(bls) experts
    per layer (2 for one sequence, nearly all 8 for 64), a prefill D(bls s); none when the
    experts live on the GPU."""
    policy = Policy(gpu_batch_size=block, experts_frac=(0.0, 1.0, 0.0))
    est = estimate(policy, MIXTRAL, WORKLOAD, GPU_BOX)
    expert = MIXTRAL.expert_weight_bytes
    decode_experts = expected_distinct_experts(8, 2, block)
    assert est.decode_terms["ctog"] * GPU_BOX.ctog_bw == pytest.approx(decode_experts * expert)
    prefill_experts = expected_distinct_experts(8, 2, block * 512)
    assert est.prefill_terms["ctog"] * GPU_BOX.ctog_bw == pytest.approx(prefill_experts * expert)
    assert est.experts[1].distinct_experts == pytest.approx(decode_experts)
    resident = estimate(
        dataclasses.replace(policy, experts_frac=(1, 0, 0)), MIXTRAL, WORKLOAD, GPU_BOX
    )
    assert resident.decode_terms["ctog"] == 0.0


def test_the_lp_homes_more_experts_on_the_gpu_as_gpu_memory_grows() -> None:
    """One block shape, short sequences (the KV cache is small): the attention, router and
    embeddings take the GPU first (every block loads all of them, but only the 7.2 of 8
    experts 8 sequences touch), then the experts fill what is left, all of them at 120 GiB."""
    lp, choice = PlacementLP(), Policy(gpu_batch_size=8)
    short = WorkloadSpec(prompt_len=64, gen_len=8)
    on_gpu = []
    for gpu_mem in (16, 32, 64, 120):
        budgets = hardware_budgets(GPU_BOX, gpu_mem=gpu_mem * GiB)
        x = lp.solve(build_terms(MIXTRAL, short, GPU_BOX, choice, budgets))
        assert x is not None and x[0] == pytest.approx(1.0, abs=1e-3)  # wg
        on_gpu.append(x[9])  # eg
    assert 0.0 < on_gpu[0] < on_gpu[1] < on_gpu[2] < on_gpu[3] == pytest.approx(1.0, abs=1e-3)
    result = search(MIXTRAL, WORKLOAD, GPU_BOX, gpu_mem=120 * GiB)
    assert experts_per_tier(MIXTRAL, result.policy) == (8, 0, 0)


def test_break_even_is_where_cpu_compute_meets_the_copy() -> None:
    break_even = cpu_expert_break_even(MIXTRAL, CPU_BOX, num_threads=27)
    copy = expert_copy_seconds(MIXTRAL, CPU_BOX, compressed=False)
    assert break_even > 0
    assert cpu_expert_seconds(MIXTRAL, CPU_BOX, break_even, 27) < copy
    assert cpu_expert_seconds(MIXTRAL, CPU_BOX, break_even + 1, 27) >= copy
    # Host memory slower than PCIe: reading an expert on the CPU loses to copying it.
    assert cpu_expert_break_even(MIXTRAL, GPU_BOX, num_threads=11) == 0
    assert cpu_expert_break_even(BUILTIN_MODELS["llama-3-8b"], CPU_BOX) == 0


@pytest.mark.parametrize("block", [16, 4096])
def test_cpu_experts_compute_below_the_break_even_and_copy_above(block: int) -> None:
    policy = Policy(
        gpu_batch_size=block,
        experts_frac=(0.0, 1.0, 0.0),
        cpu_experts=True,
        num_cpu_threads=27,
    )
    est = estimate(policy, MIXTRAL, WORKLOAD, CPU_BOX)
    decode = est.experts[1]
    below = decode.tokens_per_expert <= cpu_expert_break_even(MIXTRAL, CPU_BOX, 27)
    assert decode.cpu_compute == below == (block == 16)
    copied = est.decode_terms["ctog"] * CPU_BOX.ctog_bw
    if below:  # only the routed tokens' hidden states come back
        assert copied == pytest.approx(decode.routed_bytes)
        assert est.compute_parts["cpu_experts"] == pytest.approx(decode.cpu_seconds)
    else:
        assert copied == pytest.approx(decode.expert_bytes)
        assert est.compute_parts["cpu_experts"] == 0.0
    assert not est.experts[0].cpu_compute  # prefill: thousands of tokens per expert


def test_search_chooses_cpu_experts_only_where_the_break_even_says_so() -> None:
    """Without CPU attention (one CPU lane: the experts'), Qwen3-30B-A3B on a PCIe 3.0 box
    computes its CPU-homed experts there, at a block whose decode stays under the break-even;
    on a box whose host memory is slower than PCIe the option is never taken (and changes no
    prediction)."""
    kwargs = dict(allow_compression=False, allow_cpu_attention=False)
    result = search(QWEN3_MOE, WORKLOAD, CPU_BOX, **kwargs)  # type: ignore[arg-type]
    decode = result.estimate.experts[1]
    assert result.policy.cpu_experts and decode.cpu_compute
    assert 0 < decode.tokens_per_expert <= decode.break_even_tokens
    assert result.policy.experts_frac[1] > 0.5
    slow = search(QWEN3_MOE, WORKLOAD, GPU_BOX, gpu_mem=24 * GiB, **kwargs)  # type: ignore[arg-type]
    assert not slow.policy.cpu_experts and slow.expert_break_even == 0
    with_cpu = {k: v for k, v in slow.alternatives.items() if k.endswith("cpu_experts=True")}
    for combo, throughput in with_cpu.items():
        assert slow.alternatives[combo.replace("=True", "=False")] == throughput


@pytest.mark.parametrize(
    ("hub_id", "gpu_mem", "active", "num_experts"),
    [
        # slow: the default run checks the same report lines for each model and for each
        # budget in this test's two other cases (Mixtral at 80 GiB, Qwen3 at 24 GiB)
        pytest.param(
            "mistralai/Mixtral-8x7B-v0.1",
            "24GiB",
            "12.88B active per token",
            8,
            marks=pytest.mark.slow,
        ),
        ("mistralai/Mixtral-8x7B-v0.1", "80GiB", "12.88B active per token", 8),
        ("Qwen/Qwen3-30B-A3B", "24GiB", "3.35B active per token", 128),
        pytest.param(
            "Qwen/Qwen3-30B-A3B", "80GiB", "3.35B active per token", 128, marks=pytest.mark.slow
        ),
    ],
)
def test_plan_explains_moe_placement(
    capsys: pytest.CaptureFixture[str], hub_id: str, gpu_mem: str, active: str, num_experts: int
) -> None:
    """`nanoflex plan` on the measured H100 profile, without a download: experts per tier,
    active parameters, distinct experts and expert bytes per block, the break-even."""
    argv = ["plan", "--model", hub_id, "--hardware", str(H100_PROFILE), "--gpu-mem", gpu_mem]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    moe, policy = out["moe"], Policy.from_dict(out["policy"])
    assert moe["num_experts"] == num_experts
    assert sum(moe["experts_per_layer"].values()) == num_experts
    top_k = moe["num_experts_per_tok"]
    distinct = expected_distinct_experts(num_experts, top_k, policy.block_size)
    assert moe["decode"]["distinct_experts"] == pytest.approx(distinct)
    assert moe["decode"]["expert_bytes_per_layer"] == pytest.approx(distinct * moe["expert_bytes"])
    assert main(argv) == 0
    report = capsys.readouterr().out
    gpu, cpu, disk = moe["experts_per_layer"].values()
    assert active in report.splitlines()[0]
    assert f": {gpu} / {cpu} / {disk} of {num_experts} per MoE layer" in report
    assert f"touch {distinct:.2f} of {num_experts} experts" in report
    assert "cpu expert compute: break-even " in report


def test_dense_plans_have_no_expert_fields() -> None:
    llama = BUILTIN_MODELS["llama-3-8b"]
    result = search(llama, WORKLOAD, GPU_BOX, gpu_mem=8 * GiB)
    assert result.policy.experts_frac == (1.0, 0.0, 0.0) and not result.policy.cpu_experts
    assert result.expert_break_even == 0
    report = format_report(llama, WORKLOAD, result, {})
    assert "routed experts" not in report and "mixture of experts" not in report
    assert not any("cpu_experts" in combo for combo in result.alternatives)
