"""The vision tower's tier is a planner choice: on the GPU its bytes are in the GPU's rows and
its compute at the GPU's rate; on the CPU in the host's, at the CPU's rate plus the features'
copy; the search homes it on the CPU when it does not fit beside the plan's GPU needs, and
`nanoflex plan` says where and why."""

from __future__ import annotations

import dataclasses

import pytest

from policy import FLEXGEN_T4, Policy
from policy.catalog import resolve_model_spec
from policy.cost_model import estimate
from policy.plan import format_report
from policy.policy import PolicyError
from policy.search import search
from policy.specs import WorkloadSpec
from policy.vision_cost import tower_cost
from policy.vision_report import vision_summary

GiB = 1 << 30
LLAVA = resolve_model_spec("llava-hf/llava-1.5-7b-hf")
PAGES = WorkloadSpec(64, 8, images_per_request=1, pixels_per_image=448 * 448)
POLICY = Policy(gpu_batch_size=4, kv_frac=(0.0, 1.0, 0.0), act_frac=(0.0, 1.0, 0.0))


def test_the_tower_on_the_cpu_moves_its_bytes_and_compute_there() -> None:
    """The tower's weights, cache and workspace leave the GPU's rows for the host's, to the
    byte; its block's seconds are the CPU's FLOP rate's plus the features' copy."""
    cpu = dataclasses.replace(POLICY, vision_tier="cpu")
    on_gpu = estimate(POLICY, LLAVA, PAGES, FLEXGEN_T4).peak_bytes
    on_cpu = estimate(cpu, LLAVA, PAGES, FLEXGEN_T4).peak_bytes
    tower = tower_cost(LLAVA, PAGES, FLEXGEN_T4, POLICY.block_size, "gpu")
    moved = tower.prefill_bytes  # the rows' peak is the prefill's here
    assert tower.weight_bytes == 324_487_168 * 2
    assert on_gpu["gpu"] - on_cpu["gpu"] == moved == on_cpu["cpu"] - on_gpu["cpu"]
    host = tower_cost(LLAVA, PAGES, FLEXGEN_T4, POLICY.block_size, "cpu")
    assert LLAVA.vision is not None
    flops = LLAVA.vision.flops_per_image(PAGES.pixels_per_image)
    copy = LLAVA.vision.feature_bytes(PAGES.pixels_per_image, 2) / FLEXGEN_T4.ctog_bw
    assert host.block_seconds == POLICY.block_size * (flops / FLEXGEN_T4.cpu_flops + copy)
    assert host.block_seconds > tower.block_seconds  # a T4's FLOPs outrun its host's


def test_a_full_gpu_homes_the_tower_on_the_cpu_and_the_plan_says_why() -> None:
    """2 GiB of GPU: the 619 MiB tower and its cache do not fit beside a layer's working
    memory, so the plan runs it on the CPU (16 GiB keep Qwen2.5-VL-7B's on the GPU:
    tests/policy/test_vision_specs.py)."""
    kwargs = dict(allow_compression=False, allow_cpu_attention=False)
    tight = search(LLAVA, PAGES, FLEXGEN_T4, gpu_mem=2 * GiB, **kwargs)  # type: ignore[arg-type]
    assert tight.policy.vision_tier == "cpu" and tight.estimate.fits
    report = format_report(LLAVA, PAGES, tight, {})
    assert "home cpu (homed and run on the CPU" in report
    assert "with it on the GPU no plan fits the GPU's budget" in report
    summary = vision_summary(LLAVA, PAGES, tight)
    assert summary["home"] == "cpu" and "no plan fits" in str(summary["why"])


def test_a_policy_file_names_the_tier() -> None:
    assert Policy.from_dict({"vision_tier": "cpu"}).vision_tier == "cpu"
    assert Policy().to_dict()["vision_tier"] == "gpu"
    with pytest.raises(PolicyError, match="vision_tier must be 'gpu' or 'cpu'"):
        Policy(vision_tier="disk")


def test_a_gpu_share_worth_more_to_weights_sends_a_fitting_tower_to_the_cpu() -> None:
    """4 GiB fit the tower on the GPU, but beside a CPU as fast as the T4 (a stand-in profile)
    its 1.7 GiB there (weights, cache) are worth more as the language model's weights: the
    plan encodes on the CPU and says what the GPU's tower would have predicted."""
    fast_host = dataclasses.replace(FLEXGEN_T4, cpu_flops=FLEXGEN_T4.gpu_flops)
    kwargs = dict(allow_compression=False, allow_cpu_attention=False)
    result = search(LLAVA, PAGES, fast_host, gpu_mem=4 * GiB, **kwargs)  # type: ignore[arg-type]
    on_gpu = result.alternatives[
        "compress_weights=False compress_kv=False cpu_attention=False vision_tier=gpu"
    ]
    assert result.policy.vision_tier == "cpu"
    assert result.predicted["generation_throughput"] > on_gpu > 0
    why = vision_summary(LLAVA, PAGES, result)["why"]
    assert f"on the GPU the best plan predicts {on_gpu:.2f} tok/s" in str(why)
