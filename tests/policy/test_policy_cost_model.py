"""Cost model terms: sizes, overlap, compression, CPU attention, peak memory."""

import dataclasses

import pytest

from policy.catalog import BUILTIN_MODELS
from policy.cost_model import compressed_bytes_per_element, estimate
from policy.hardware import FLEXGEN_T4
from policy.paper import FLEXGEN_TABLE15
from policy.policy import Policy
from policy.specs import WorkloadSpec

OPT_30B = BUILTIN_MODELS["opt-30b"]
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
PAPER_30B = FLEXGEN_TABLE15["opt-30b"]  # FlexGen's own OPT-30B policy


def test_compressed_bytes_are_about_028_of_fp16() -> None:
    assert compressed_bytes_per_element(2) / 2 == pytest.approx(0.28, abs=0.005)


def test_throughput_definitions_follow_design_section_8() -> None:
    est = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    layers, bls = OPT_30B.num_layers, PAPER_30B.block_size
    prefill_s, decode_s = layers * est.prefill_time, layers * 31 * est.decode_time
    assert est.prefill_throughput == pytest.approx(bls * 512 / prefill_s)
    assert est.decode_throughput == pytest.approx(bls * 31 / decode_s)
    assert est.generation_throughput == pytest.approx(bls * 32 / (prefill_s + decode_s))


def test_paper_policy_lands_near_the_paper_number() -> None:
    est = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    assert est.generation_throughput == pytest.approx(7.32, rel=0.15)  # Table 15
    assert est.bottleneck == "decode:cpu_compute"


def test_overlap_off_sums_the_tasks() -> None:
    on = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    off = estimate(dataclasses.replace(PAPER_30B, overlap=False), OPT_30B, WORKLOAD, FLEXGEN_T4)
    assert off.decode_time == pytest.approx(sum(on.decode_terms.values()))
    assert off.generation_throughput < on.generation_throughput


def test_cpu_attention_moves_only_q_and_new_kv() -> None:
    gpu_attention = dataclasses.replace(PAPER_30B, cpu_attention=False)
    with_cpu = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    without = estimate(gpu_attention, OPT_30B, WORKLOAD, FLEXGEN_T4)
    assert with_cpu.decode_terms["ctog"] < 0.5 * without.decode_terms["ctog"]
    assert with_cpu.compute_parts["cpu_compute"] > 0 == without.compute_parts["cpu_compute"]


def test_compression_shrinks_moved_and_homed_bytes() -> None:
    gpu_attention = dataclasses.replace(PAPER_30B, cpu_attention=False)
    compressed = dataclasses.replace(gpu_attention, compress_weights=True, compress_kv=True)
    plain = estimate(gpu_attention, OPT_30B, WORKLOAD, FLEXGEN_T4)
    small = estimate(compressed, OPT_30B, WORKLOAD, FLEXGEN_T4)
    assert small.decode_terms["ctog"] == pytest.approx(0.28 * plain.decode_terms["ctog"], rel=0.05)
    assert small.peak_bytes["cpu"] < 0.35 * plain.peak_bytes["cpu"]
    assert small.compute_parts["gpu_compute"] > plain.compute_parts["gpu_compute"]  # dequant


def test_peak_memory_grows_with_the_block() -> None:
    small = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    big = estimate(dataclasses.replace(PAPER_30B, num_gpu_batches=6), OPT_30B, WORKLOAD, FLEXGEN_T4)
    assert big.peak_bytes["cpu"] > small.peak_bytes["cpu"]
    assert big.peak_bytes["gpu"] >= small.peak_bytes["gpu"]


def test_lm_offload_cpu_attention_decides_whether_kv_compression_pays() -> None:
    """LM-Offload Obs. 1: with GPU attention 4-bit KV cuts PCIe traffic and pays; with
    CPU attention the KV never crosses PCIe, so 4-bit KV only adds dequantization."""
    placement = dict(weights_frac=(0.0, 1.0, 0.0), kv_frac=(0.0, 1.0, 0.0), act_frac=(1, 0, 0))
    results = {}
    for cpu_attention in (False, True):
        for compress_kv in (False, True):
            policy = Policy(
                gpu_batch_size=32,
                num_gpu_batches=4,
                cpu_attention=cpu_attention,
                compress_kv=compress_kv,
                **placement,  # type: ignore[arg-type]
            )
            est = estimate(policy, OPT_30B, WORKLOAD, FLEXGEN_T4)
            results[cpu_attention, compress_kv] = est.generation_throughput
    assert results[False, True] > results[False, False]  # GPU attention: compression pays
    assert results[True, True] < results[True, False]  # CPU attention: it does not


def test_policy_json_round_trip_with_thread_fields() -> None:
    policy = dataclasses.replace(PAPER_30B, num_cpu_threads=8)
    assert Policy.from_json(policy.to_json()) == policy


@pytest.mark.parametrize(
    ("case", "documented"),
    [
        ("opt-30b", 7.28),
        ("opt-30b-compressed", 7.39),
        ("opt-175b", 0.48),
        ("opt-175b-compressed", 1.47),
    ],
)
def test_paper_policies_match_docs_policy_md(case: str, documented: float) -> None:
    """The "model on paper policy" column of docs/policy.md section 6, reproduced."""
    model = BUILTIN_MODELS[case.removesuffix("-compressed")]
    est = estimate(FLEXGEN_TABLE15[case], model, WORKLOAD, FLEXGEN_T4)
    assert est.generation_throughput == pytest.approx(documented, abs=0.005)


def test_on_a_cpu_box_disk_io_costs_compute_its_measured_share() -> None:
    """The copy threads and the compute share a CPU box's cores: decode compute grows by
    share x seconds of disk I/O (small reads for KV pages), and not at all on a GPU."""
    kv_on_disk = Policy(gpu_batch_size=12, num_gpu_batches=2, kv_frac=(0.0, 0.0, 1.0))
    cpu_box = dataclasses.replace(FLEXGEN_T4, compute_device="cpu")
    sharing = dataclasses.replace(cpu_box, io_compute_share_small=0.5)
    base = estimate(kv_on_disk, OPT_30B, WORKLOAD, cpu_box)
    shared = estimate(kv_on_disk, OPT_30B, WORKLOAD, sharing)
    reads = base.decode_terms["dtoc"] + base.decode_terms["ctod"]  # all KV on disk here
    assert shared.decode_terms["compute"] - base.decode_terms["compute"] == pytest.approx(
        0.5 * reads
    )
    on_gpu = dataclasses.replace(sharing, compute_device="cuda")
    assert estimate(kv_on_disk, OPT_30B, WORKLOAD, on_gpu).decode_terms == (
        estimate(kv_on_disk, OPT_30B, WORKLOAD, FLEXGEN_T4).decode_terms
    )


def test_one_gpu_batch_puts_the_activation_round_trip_on_the_critical_path() -> None:
    def compute(num_gpu_batches: int, act: tuple[float, float, float]) -> float:
        policy = Policy(gpu_batch_size=24 // num_gpu_batches, num_gpu_batches=num_gpu_batches)
        policy = dataclasses.replace(policy, act_frac=act)
        return estimate(policy, OPT_30B, WORKLOAD, FLEXGEN_T4).decode_terms["compute"]

    act_bytes = 24 * OPT_30B.hidden_bytes_per_token
    trip = act_bytes * (
        1 / FLEXGEN_T4.gtoc_bw
        + 1 / FLEXGEN_T4.ctod_bw
        + 1 / FLEXGEN_T4.dtoc_bw
        + 1 / FLEXGEN_T4.ctog_bw
    )
    assert compute(1, (0, 0, 1)) - compute(1, (1, 0, 0)) == pytest.approx(trip)
    assert compute(2, (0, 0, 1)) == pytest.approx(compute(2, (1, 0, 0)))  # overlapped instead


def test_prefix_break_even_follows_the_tier_bandwidth() -> None:
    """Loading cached KV wins at once from fast tiers; from a slow disk next to a fast GPU
    only long prefixes (where the prefill's attention grows quadratically) are worth it."""
    from policy.prefix import break_even_tokens, load_seconds, recompute_seconds

    model = BUILTIN_MODELS["llama-3-8b"]
    fast_gpu = dataclasses.replace(FLEXGEN_T4, gpu_flops=600e12, gpu_bmm_flops=400e12)
    even = break_even_tokens(model, fast_gpu)
    assert even["gpu"] == even["cpu"] == 16
    n = even["disk"]
    assert n is not None and n > 1024
    assert load_seconds(n, "disk", model, fast_gpu, False) <= recompute_seconds(n, model, fast_gpu)
    assert load_seconds(n - 16, "disk", model, fast_gpu, False) > recompute_seconds(
        n - 16, model, fast_gpu
    )
    slow_disk = dataclasses.replace(fast_gpu, dtoc_bw=1e6)
    assert break_even_tokens(model, slow_disk)["disk"] is None


def test_on_a_cpu_box_the_gpu_budget_comes_out_of_the_same_ram() -> None:
    from policy.cost_model import hardware_budgets

    box = dataclasses.replace(
        FLEXGEN_T4, compute_device="cpu", gpu_mem_bytes=12 * 2**30, cpu_mem_bytes=12 * 2**30
    )
    budgets = hardware_budgets(box, gpu_mem=16 * 2**30)
    assert budgets["gpu"] == 16 * 2**30 and budgets["cpu"] == 8 * 2**30
    default = hardware_budgets(box)  # nothing asked: the RAM is the gpu tier's
    assert default["gpu"] == 24 * 2**30 and default["cpu"] == 0
    asked = hardware_budgets(box, cpu_mem=4 * 2**30)
    assert asked["gpu"] == 20 * 2**30 and asked["cpu"] == 4 * 2**30
    assert hardware_budgets(FLEXGEN_T4, gpu_mem=16 * 2**30)["cpu"] == FLEXGEN_T4.cpu_mem_bytes


def test_overlap_that_hides_a_share_charges_the_rest_of_the_shorter() -> None:
    """A GPU whose copies hide only a share h of the shorter of copies and compute (the
    profile's `copy_hidden`, CUDA events) costs max(c, io) + (1 - h) min(c, io) a layer:
    unmeasured, or with the CPU as compute device, FlexGen's max."""
    full = estimate(PAPER_30B, OPT_30B, WORKLOAD, FLEXGEN_T4)
    terms = full.decode_terms
    compute, io = terms["compute"], max(v for k, v in terms.items() if k != "compute")
    assert full.decode_time == pytest.approx(max(compute, io))
    for hidden in (0.6, 0.0):
        part = estimate(
            PAPER_30B, OPT_30B, WORKLOAD, dataclasses.replace(FLEXGEN_T4, copy_hidden=hidden)
        )
        assert part.decode_terms == terms
        expected = max(compute, io) + (1 - hidden) * min(compute, io)
        assert part.decode_time == pytest.approx(expected)
        assert part.generation_throughput < full.generation_throughput
    cpu_box = dataclasses.replace(FLEXGEN_T4, compute_device="cpu")
    on_cpu = estimate(PAPER_30B, OPT_30B, WORKLOAD, dataclasses.replace(cpu_box, copy_hidden=0.0))
    assert on_cpu.decode_time == estimate(PAPER_30B, OPT_30B, WORKLOAD, cpu_box).decode_time


def test_disk_weights_stage_in_host_memory_on_a_gpu_and_in_compute_memory_on_a_cpu() -> None:
    """A GPU reads what lies on disk through host memory (the cpu rows hold two layers of
    it); where the compute device is the CPU, the engine reads it into the memory it
    computes in (its slots, engine/executor/budgets.py), so the cpu tier, empty there by
    default (`hardware_budgets`), holds none of it and a plan may keep weights on disk."""
    on_disk = dataclasses.replace(
        PAPER_30B, weights_frac=(0.0, 0.0, 1.0), kv_frac=(1.0, 0.0, 0.0), act_frac=(1.0, 0.0, 0.0)
    )
    layer = OPT_30B.total_params / OPT_30B.num_layers * OPT_30B.dtype_bytes
    on_gpu = estimate(on_disk, OPT_30B, WORKLOAD, FLEXGEN_T4).peak_bytes
    assert on_gpu["cpu"] >= 2 * layer
    cpu_box = dataclasses.replace(FLEXGEN_T4, compute_device="cpu")
    on_cpu = estimate(on_disk, OPT_30B, WORKLOAD, cpu_box).peak_bytes
    assert on_cpu["cpu"] == 0
    assert on_cpu["gpu"] >= 2 * layer  # the two slots, in compute memory
