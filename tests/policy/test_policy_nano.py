"""The nano-batch terms of the cost model (NanoFlow 4.3) and the search choosing the count."""

import dataclasses

import numpy as np
import pytest

from policy import Policy
from policy.affine import VARS, ZERO, Affine
from policy.catalog import BUILTIN_MODELS
from policy.cost_model import estimate
from policy.hardware import FLEXGEN_T4, HardwareSpec
from policy.nano_batching import dense_seconds, overlapped_compute
from policy.paper import FLEXGEN_TABLE15
from policy.plan import format_report
from policy.search import search
from policy.specs import WorkloadSpec

GiB = 1024**3
X = np.zeros(len(VARS))
MEASURED_T4 = dataclasses.replace(FLEXGEN_T4, nano_overlap_device=1.0, nano_overlap_host=1.0)
# A resident-weights box (H100-like numbers) whose profile measured the overlap.
H100 = HardwareSpec(
    gpu_mem_bytes=80 * GiB,
    cpu_mem_bytes=128 * GiB,
    disk_mem_bytes=1000 * GiB,
    ctog_bw=25e9,
    gtoc_bw=25e9,
    dtoc_bw=3e9,
    ctod_bw=2e9,
    gpu_flops=600e12,
    gpu_bmm_flops=300e12,
    cpu_flops=1.5e12,
    num_cpu_cores=16,
    gpu_mem_bw=3e12,
    layer_overhead_s=5e-5,
)
LLAMA_3_8B = BUILTIN_MODELS["llama-3-8b"]
DECODE_HEAVY = WorkloadSpec(prompt_len=512, gen_len=256)


@pytest.mark.parametrize(("num_nano", "seconds"), [(1, 10.0), (2, 8.0), (4, 7.0)])
def test_overlap_hides_all_but_one_nano_batch_of_the_shorter_lane(
    num_nano: int, seconds: float
) -> None:
    """4 s of dense ops beside 6 s of CPU attention: the sum in one piece; with n pieces and
    full overlap, the longer lane plus a fill/drain of 1/n of the shorter."""
    task = overlapped_compute(4.0, ZERO, Affine.of(6.0), ZERO, num_nano, MEASURED_T4)
    assert task(X) == pytest.approx(seconds)
    unmeasured = overlapped_compute(4.0, ZERO, Affine.of(6.0), ZERO, num_nano, FLEXGEN_T4)
    assert unmeasured(X) == pytest.approx(10.0)  # not measured: nothing is hidden


def test_three_lanes_and_serial_work() -> None:
    """Dense 4, GPU attention 2, CPU attention 6, serial 1, two pieces, full overlap: the GPU
    lane takes 4 + 2 - 1 = 5, beside the CPU's 6 it takes 6 + 5/2; serial work adds on."""
    gpu, cpu = Affine.of(cg=2.0), Affine.of(cc=6.0)
    task = overlapped_compute(4.0, gpu, cpu, Affine.of(1.0), 2, MEASURED_T4)
    x = np.array([0, 0, 0, 1.0, 1.0, 0, 0, 0, 0, 0, 0, 0])  # cg = cc = 1 picks both attentions
    assert task(x) == pytest.approx(1.0 + 6.0 + 5.0 / 2)
    half = dataclasses.replace(MEASURED_T4, nano_overlap_device=0.5, nano_overlap_host=0.5)
    assert overlapped_compute(4.0, gpu, cpu, ZERO, 2, half)(x) == pytest.approx(
        (4 + 2 - 0.5) + 6 - 0.25 * 5.5
    )


def test_cutting_reads_the_weights_and_pays_the_fixed_cost_per_piece() -> None:
    hw = dataclasses.replace(FLEXGEN_T4, layer_overhead_s=1e-4)
    weight_bound = dense_seconds(1e9, 1e9, 5e8, hw, 1)  # 1 GFLOP: reading 1 GB of weights binds
    assert dense_seconds(1e9, 1e9, 5e8, hw, 4) == pytest.approx(4 * weight_bound)
    flop_bound = dense_seconds(1e15, 1e6, 5e5, hw, 1)
    assert dense_seconds(1e15, 1e6, 5e5, hw, 4) == pytest.approx(flop_bound + 3e-4)
    measured = dataclasses.replace(hw, nano_batch_overhead_s=2e-5)  # a piece costs less
    assert dense_seconds(1e15, 1e6, 5e5, measured, 4) == pytest.approx(flop_bound + 6e-5)


def test_cpu_attention_policy_gains_only_where_the_overlap_was_measured() -> None:
    """A block bound by CPU attention whose GPU batches are big enough for FLOP-bound dense
    ops: two nano-batches hide half of them behind the CPU, if the profile says they overlap."""
    model, workload = BUILTIN_MODELS["opt-30b"], WorkloadSpec(512, 32)
    one = dataclasses.replace(FLEXGEN_TABLE15["opt-30b"], gpu_batch_size=256, num_gpu_batches=1)
    two = dataclasses.replace(one, num_nano_batches=2)
    one_t4, two_t4 = (estimate(p, model, workload, MEASURED_T4) for p in (one, two))
    assert one_t4.bottleneck == two_t4.bottleneck == "decode:cpu_compute"
    dense = one_t4.compute_parts["dense"]
    assert two_t4.decode_terms["compute"] < one_t4.decode_terms["compute"] - 0.2 * dense
    assert two_t4.generation_throughput > one_t4.generation_throughput
    assert estimate(one, model, workload, FLEXGEN_T4).predicted() == one_t4.predicted()
    unmeasured = estimate(two, model, workload, FLEXGEN_T4)
    assert unmeasured.generation_throughput < one_t4.generation_throughput  # only the cost


def test_weight_read_bound_pieces_cost_what_overlap_hides() -> None:
    """FlexGen's own OPT-30B policy (48 sequences per GPU batch): each nano-batch's dense ops
    read all the layer's weights, so n pieces take n times as long and the 1/n that cannot
    hide equals the uncut time: nano-batching gains nothing there, and the model says so."""
    paper = FLEXGEN_TABLE15["opt-30b"]
    model, workload = BUILTIN_MODELS["opt-30b"], WorkloadSpec(512, 32)
    one = estimate(paper, model, workload, MEASURED_T4)
    for n in (2, 4):
        cut = estimate(dataclasses.replace(paper, num_nano_batches=n), model, workload, MEASURED_T4)
        assert cut.compute_parts["dense"] == pytest.approx(n * one.compute_parts["dense"])
        assert cut.decode_terms["compute"] == pytest.approx(one.decode_terms["compute"])


def test_search_picks_nano_batches_where_they_pay_and_plan_says_why() -> None:
    measured = dataclasses.replace(H100, nano_overlap_device=0.8, nano_overlap_host=0.9)
    chosen = search(LLAMA_3_8B, DECODE_HEAVY, measured)
    assert chosen.policy.num_nano_batches == 2
    assert set(chosen.nano_estimates) == {1, 2, 4}
    one = chosen.nano_estimates[1].generation_throughput
    assert chosen.predicted["generation_throughput"] > 1.02 * one  # NANO_MIN_GAIN
    report = format_report(LLAMA_3_8B, DECODE_HEAVY, chosen, {})
    assert "nano-batches    2" in report and "in one piece" in report
    assert "cost of cutting" in report
    plain = search(LLAMA_3_8B, DECODE_HEAVY, H100)  # no overlap measured: one nano-batch
    assert plain.policy.num_nano_batches == 1
    assert "nano-batches: 1, cutting the GPU batch costs more" in format_report(
        LLAMA_3_8B, DECODE_HEAVY, plain, {}
    )


@pytest.mark.parametrize("share", ["nano_overlap_device", "nano_overlap_host", "copy_hidden"])
def test_hardware_rejects_overlap_shares_outside_zero_one(share: str) -> None:
    data = {**FLEXGEN_T4.to_dict(), share: 1.5}
    with pytest.raises(ValueError, match=share):
        HardwareSpec.from_dict(data)
    assert HardwareSpec.from_json(MEASURED_T4.to_json()) == MEASURED_T4


def test_nano_batches_are_charged_the_packed_attention_they_run() -> None:
    """The engine reads a nano-batch's KV through the packed path (gather + SDPA), a whole
    batch's in place through its kernels: with the packed path measured 4x slower, cutting
    the batch costs decode that attention, and whole batches do not (on a busy CPU a plan of
    4 nano-batches once won on a share that hid this)."""
    paged = dataclasses.replace(H100, device_attention_bw=2e12, nano_overlap_device=0.5)
    packed = dataclasses.replace(paged, packed_attention_bw=0.5e12)
    whole = Policy(gpu_batch_size=64)
    cut = dataclasses.replace(whole, num_nano_batches=2)
    for hardware in (paged, packed):  # whole batches never read packed
        assert hardware.decode_attention_bw(1) == 2e12
    assert packed.decode_attention_bw(2) == 0.5e12 and paged.decode_attention_bw(2) == 2e12
    one = estimate(whole, LLAMA_3_8B, DECODE_HEAVY, packed).predicted()
    assert one == estimate(whole, LLAMA_3_8B, DECODE_HEAVY, paged).predicted()
    charged = estimate(cut, LLAMA_3_8B, DECODE_HEAVY, packed).predicted()
    free = estimate(cut, LLAMA_3_8B, DECODE_HEAVY, paged).predicted()
    assert charged["decode_throughput"] < free["decode_throughput"]
