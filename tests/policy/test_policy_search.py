"""Policy search: feasibility, infeasibility messages, monotonicity, compression choices."""

import dataclasses

import pytest

from policy.catalog import BUILTIN_MODELS, resolve_model_spec
from policy.hardware import FLEXGEN_T4, HardwareSpec
from policy.search import COMPRESSION_MIN_GAIN, MIN_GAIN, PlanResult, PolicyInfeasible, search
from policy.specs import ModelSpec, WorkloadSpec

GiB = 1024**3
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
# A small offloading box: 8 GiB GPU, 32 GiB DRAM, NVMe, 16 cores.
BOX = HardwareSpec(
    gpu_mem_bytes=8 * GiB,
    cpu_mem_bytes=32 * GiB,
    disk_mem_bytes=1024 * GiB,
    ctog_bw=8e9,
    gtoc_bw=8e9,
    dtoc_bw=2e9,
    ctod_bw=1e9,
    gpu_flops=60e12,
    gpu_bmm_flops=20e12,
    cpu_flops=1e12,
    num_cpu_cores=16,
)
OPT_13B = BUILTIN_MODELS["opt-13b"]


PLANS: dict[tuple[str, str, bool], PlanResult] = {}


def planned(model: ModelSpec, hardware: HardwareSpec, allow_compression: bool = True) -> PlanResult:
    """search() on WORKLOAD, once per (model, hardware, compression) in this module: tests
    read the same plans (OPT-13B on BOX: eight reads) and a search takes seconds. Keyed by
    the specs' reprs (their dict fields make them unhashable); a PlanResult is only read."""
    key = (repr(model), repr(hardware), allow_compression)
    if key not in PLANS:
        PLANS[key] = search(model, WORKLOAD, hardware, allow_compression=allow_compression)
    return PLANS[key]


def _throughput(model: ModelSpec, hardware: HardwareSpec, allow_compression: bool = True) -> float:
    return planned(model, hardware, allow_compression).predicted["generation_throughput"]


def test_demo_model_fits_on_the_gpu() -> None:
    result = search(resolve_model_spec(None), WORKLOAD, BOX)
    assert result.policy.weights_frac == (1.0, 0.0, 0.0)
    assert result.policy.kv_frac == (1.0, 0.0, 0.0)
    assert not (result.policy.compress_weights or result.policy.compress_kv)
    assert set(result.to_dict()) == {"policy", "predicted", "bottleneck"}
    assert result.estimate.fits


def test_offloaded_plan_is_consistent_with_the_cost_model() -> None:
    result = planned(OPT_13B, BOX)
    policy, est = result.policy, result.estimate
    assert est.fits
    assert policy.weights_frac[0] < 1.0  # 26 GB of weights cannot all sit in 8 GiB
    assert result.bottleneck.startswith(("decode:", "prefill:"))
    assert result.predicted == est.predicted()


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"gpu_mem": 256 * 1024**2}, "gpu working memory"),
        ({"gpu_mem": 5 * GiB, "cpu_mem": GiB, "disk_mem": GiB}, "across gpu\\+cpu\\+disk"),
    ],
)
def test_infeasible_budgets_say_what_does_not_fit(budgets: dict[str, int], message: str) -> None:
    with pytest.raises(PolicyInfeasible, match=message) as info:
        search(OPT_13B, WORKLOAD, BOX, **budgets)  # type: ignore[arg-type]
    assert "short by" in str(info.value)


@pytest.mark.parametrize(
    "more",
    [
        {"gpu_mem_bytes": 12 * GiB},
        {"cpu_mem_bytes": 64 * GiB},
        {"ctog_bw": 16e9, "gtoc_bw": 16e9},
        {"dtoc_bw": 4e9, "ctod_bw": 2e9},
    ],
)
def test_more_memory_or_bandwidth_never_lowers_throughput(more: dict[str, float]) -> None:
    richer = dataclasses.replace(BOX, **more)  # type: ignore[arg-type]
    base = _throughput(OPT_13B, BOX, allow_compression=False)
    assert _throughput(OPT_13B, richer, allow_compression=False) >= base * (1 - MIN_GAIN)
    # With compression allowed the search trades up to COMPRESSION_MIN_GAIN per tensor
    # kind for accuracy, so the raw prediction may dip by at most that much.
    slack = 1 + 2 * COMPRESSION_MIN_GAIN
    assert _throughput(OPT_13B, richer) >= _throughput(OPT_13B, BOX) / slack


def test_compression_chosen_when_io_bound() -> None:
    result = planned(OPT_13B, BOX)
    assert result.policy.compress_weights or result.policy.compress_kv
    plain = _throughput(OPT_13B, BOX, allow_compression=False)
    assert result.predicted["generation_throughput"] > plain * (1 + COMPRESSION_MIN_GAIN)


def test_compression_not_chosen_when_compute_bound() -> None:
    result = search(BUILTIN_MODELS["opt-1.3b"], WORKLOAD, FLEXGEN_T4)
    assert not (result.policy.compress_weights or result.policy.compress_kv)
    assert result.policy.weights_frac == (1.0, 0.0, 0.0)
    assert "compute" in result.bottleneck


def test_cpu_attention_decides_whether_kv_compression_pays() -> None:
    """LM-Offload Obs. 1 at the search level: 4-bit KV pays more with GPU attention (it cuts
    PCIe traffic) than with CPU attention (no KV crosses PCIe; dequantization is added), where
    what it still buys is memory: a larger block. At a fixed placement it does not pay at all
    with CPU attention (test_policy_cost_model)."""
    alternatives = planned(OPT_13B, BOX).alternatives

    def best(compress_kv: bool, cpu_attention: bool) -> float:
        key = f"compress_weights=False compress_kv={compress_kv} cpu_attention={cpu_attention}"
        return alternatives[key]

    assert best(True, False) > best(False, False)
    gain_gpu = best(True, False) / best(False, False)
    gain_cpu = best(True, True) / best(False, True)
    assert gain_gpu > gain_cpu
