"""The planner prices a vision model's tower: its parameters as transformers counts them, its
bytes in the compute device's memory, its compute per image and the image tokens' KV."""

from __future__ import annotations

import dataclasses

import pytest

from policy import FLEXGEN_T4, Policy
from policy.catalog import GEMMA3_TOWER, QWEN2_5_VL_TOWER, QWEN3_VL_TOWER, resolve_model_spec
from policy.cost_model import estimate
from policy.errors import ModelSpecError
from policy.plan import format_report
from policy.search import PlanResult, search
from policy.specs import ModelSpec, WorkloadSpec
from policy.vision import CACHED_IMAGES, vision_spec
from policy.vision_report import vision_summary
from tests.engine.vision_models import SPEC

GiB = 1 << 30
VL_7B = resolve_model_spec("Qwen/Qwen2.5-VL-7B-Instruct")
POLICY = Policy(gpu_batch_size=4, kv_frac=(0.0, 1.0, 0.0), act_frac=(0.0, 1.0, 0.0))
"""Weights on the GPU, KV and activations in host memory: the KV is read off the CPU row."""
PAGE = 448 * 448
"""A small page: 16 x 16 tokens of 28 x 28 pixels."""


def _hf_tower_params(vision_config: dict[str, object]) -> int:
    """transformers' count of a Qwen2.5-VL vision model's parameters (built on the meta
    device: no memory for the 7B's)."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLConfig(vision_config=vision_config).vision_config
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    return sum(p.numel() for p in tower.parameters())


def test_the_tower_has_transformers_parameter_count() -> None:
    """The tiny test checkpoint's tower and Qwen2.5-VL-7B's (its released config.json, the
    language model's fields at the top level: 8.29B in all, as its model card says)."""
    tiny = ModelSpec.from_hf_config(SPEC)
    assert tiny.vision is not None and tiny.model_type == "qwen2"
    assert tiny.vision.params == _hf_tower_params(dict(SPEC["vision_config"]))
    assert VL_7B.vision is not None
    real = {**QWEN2_5_VL_TOWER, "out_hidden_size": 3584}
    real["in_channels"] = real.pop("in_chans")  # transformers 5's name
    assert VL_7B.vision.params == _hf_tower_params(real) == 676_550_144
    assert VL_7B.total_params + VL_7B.vision.params == 8_292_166_656


def test_the_tower_and_its_cache_are_in_the_gpu_budget() -> None:
    """The tower's weights are a constant of the GPU's memory (resident, as the engine keeps
    them); with images, the encoded images the engine keeps too."""
    text = dataclasses.replace(VL_7B, vision=None)
    tower = VL_7B.vision
    assert tower is not None
    tower_bytes = tower.params * VL_7B.dtype_bytes
    plain = WorkloadSpec(64, 8)
    with_tower = estimate(POLICY, VL_7B, plain, FLEXGEN_T4).peak_bytes["gpu"]
    assert with_tower - estimate(POLICY, text, plain, FLEXGEN_T4).peak_bytes["gpu"] == tower_bytes
    pages = WorkloadSpec(64, 8, images_per_request=1, pixels_per_image=PAGE)
    cached = CACHED_IMAGES * 256 * 3584 * 2  # 256 tokens of 3584 bfloat16 values each
    assert estimate(POLICY, VL_7B, pages, FLEXGEN_T4).peak_bytes["gpu"] >= with_tower + cached


def test_image_tokens_are_priced_as_prompt_tokens() -> None:
    """A page's 256 tokens take the KV of 256 text tokens (the host row holds the KV here)."""
    assert VL_7B.vision is not None and VL_7B.vision.tokens_per_image(PAGE) == 256
    pages = WorkloadSpec(64, 8, images_per_request=2, pixels_per_image=PAGE)
    text = WorkloadSpec(64 + 512, 8)
    cpu = estimate(POLICY, VL_7B, pages, FLEXGEN_T4).peak_bytes["cpu"]
    assert cpu == estimate(POLICY, VL_7B, text, FLEXGEN_T4).peak_bytes["cpu"]


def test_more_images_per_request_lower_the_predicted_throughput() -> None:
    """Each image adds tokens to every prompt and a pass through the tower."""
    throughputs = [
        estimate(
            POLICY, VL_7B, WorkloadSpec(64, 8, images, pixels_per_image=PAGE), FLEXGEN_T4
        ).generation_throughput
        for images in (0, 1, 2, 4)
    ]
    assert throughputs == sorted(throughputs, reverse=True) and len(set(throughputs)) == 4
    # the tower's own compute, beside the tokens: more than the same tokens as text
    same_tokens = WorkloadSpec(64 + 256, 8)
    text = estimate(POLICY, VL_7B, same_tokens, FLEXGEN_T4).generation_throughput
    assert throughputs[1] < text


@pytest.fixture(scope="module")
def planned_7b() -> tuple[WorkloadSpec, PlanResult]:
    workload = WorkloadSpec(64, 8, images_per_request=1, pixels_per_image=PAGE)
    # one design each way (no compression, no CPU attention) keeps the search to a second
    kwargs = dict(gpu_mem=16 * GiB, allow_compression=False, allow_cpu_attention=False)
    return workload, search(VL_7B, workload, FLEXGEN_T4, **kwargs)  # type: ignore[arg-type]


def test_a_7b_vlm_plans_under_16_gib_and_says_where_its_tower_lives(
    planned_7b: tuple[WorkloadSpec, PlanResult],
) -> None:
    workload, result = planned_7b
    assert result.estimate.fits
    assert result.estimate.peak_bytes["gpu"] <= 16 * GiB
    report = format_report(VL_7B, workload, result, {})
    assert "vision tower: 0.68B parameters, 1.3 GiB of weights, home gpu" in report
    assert "per image: 256 tokens" in report and "256 image tokens" in report
    summary = vision_summary(VL_7B, workload, result)  # `nanoflex plan --json`'s "vision"
    assert summary["home"] == "gpu" and summary["weight_bytes"] == 676_550_144 * 2
    assert summary["tokens_per_image"] == 256


def test_the_planner_prices_the_engines_cache_of_encoded_images() -> None:
    from engine.executor import vision_encoder

    assert vision_encoder.CACHED_IMAGES == CACHED_IMAGES


def _hf_gemma3_tower_params(config: dict[str, object]) -> int:
    """transformers' count of Gemma3ForConditionalGeneration's vision_tower and
    multi_modal_projector, the classes Gemma3Model builds (on the meta device)."""
    import torch
    from transformers import AutoModel, Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    full = Gemma3Config(**config)
    with torch.device("meta"):
        parts = (AutoModel.from_config(full.vision_config), Gemma3MultiModalProjector(full))
    return sum(p.numel() for part in parts for p in part.parameters())


def _hf_qwen3_vl_tower_params(config: dict[str, object], moe: bool = False) -> int:
    """transformers' count of Qwen3-VL's (or Qwen3-VL-MoE's) `visual`, DeepStack mergers
    included (on the meta device)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    kind = (Qwen3VLMoeConfig, Qwen3VLMoeVisionModel) if moe else (Qwen3VLConfig, Qwen3VLVisionModel)
    vision_config = kind[0](vision_config=config["vision_config"]).vision_config
    with torch.device("meta"):
        tower = kind[1]._from_config(vision_config)
    return sum(p.numel() for p in tower.parameters())


@pytest.mark.parametrize("name", ["gemma-3-4b-it", "gemma-3-12b-it", "gemma-3-27b-it"])
def test_gemma3_siglip_has_transformers_parameter_count(name: str) -> None:
    """Each released shape (the catalogue's, as its config.json keeps it), 256 tokens per
    image whatever its pixels."""
    spec = resolve_model_spec(f"google/{name}")
    assert spec.vision is not None and spec.model_type == "gemma3_text"
    config = {
        "vision_config": GEMMA3_TOWER,
        "text_config": {"hidden_size": spec.hidden_size},
        "mm_tokens_per_image": 256,
    }
    assert spec.vision.params == _hf_gemma3_tower_params(config)
    assert {spec.vision.tokens_per_image(p) for p in (PAGE, 4 * PAGE, 64)} == {256}
    assert spec.vision.patches_per_image(PAGE) == 64 * 64  # 896 / 14 per side


def test_a_tiny_gemma3_tower_and_siglips_head() -> None:
    """The engine tests' tiny checkpoint (16 tokens per image), and with SigLIP's pooling
    head, which transformers builds (and counts) where `vision_use_head` is not turned off."""
    from tests.engine.gemma3_vision_model import SPEC as GEMMA3

    tiny = ModelSpec.from_hf_config(GEMMA3)
    assert tiny.vision is not None and tiny.vision.tokens_per_image(PAGE) == 16
    assert tiny.vision.params == _hf_gemma3_tower_params(GEMMA3)
    vision = {k: v for k, v in dict(GEMMA3["vision_config"]).items() if k != "vision_use_head"}
    headed = {**GEMMA3, "vision_config": vision}
    assert ModelSpec.from_hf_config(headed).vision.params == _hf_gemma3_tower_params(headed)  # type: ignore[union-attr]
    with pytest.raises(ModelSpecError, match="mm_tokens_per_image 15 does not pool 8 x 8"):
        ModelSpec.from_hf_config({**GEMMA3, "mm_tokens_per_image": 15})


def test_qwen3_vl_towers_have_transformers_parameter_count() -> None:
    """The tiny test checkpoint's tower (its DeepStack merger included), Qwen3-VL-8B's and a
    Qwen3-VL-MoE of the same tower (its own reader's model type)."""
    from tests.engine.qwen3_vl_models import SPEC as QWEN3_VL

    tiny = ModelSpec.from_hf_config(QWEN3_VL)
    assert tiny.vision is not None and tiny.model_type == "qwen3"
    assert tiny.vision.params == _hf_qwen3_vl_tower_params(QWEN3_VL)
    real = resolve_model_spec("Qwen/Qwen3-VL-8B-Instruct")
    assert real.vision is not None
    config = {"vision_config": {**QWEN3_VL_TOWER, "out_hidden_size": 4096}}
    assert real.vision.params == _hf_qwen3_vl_tower_params(config)
    moe = vision_spec(config, "qwen3_vl_moe")
    assert moe is not None and moe.params == _hf_qwen3_vl_tower_params(config, moe=True)


def test_qwen3_vl_tokens_follow_its_patches_and_merge() -> None:
    """16-pixel patches merged 2 x 2: a token per 32 x 32 pixels (Qwen2.5-VL: 28 x 28); the
    tower's compute grows with the image, Gemma 3's does not."""
    qwen = resolve_model_spec("qwen3-vl-8b").vision
    gemma = resolve_model_spec("gemma-3-12b-it").vision
    assert qwen is not None and gemma is not None
    assert qwen.tokens_per_image(512 * 512) == 256 and qwen.tokens_per_image(PAGE) == 196
    assert qwen.patches_per_image(512 * 512) == 1024
    assert qwen.flops_per_image(4 * PAGE) > 4 * qwen.flops_per_image(PAGE) > 0
    assert gemma.flops_per_image(4 * PAGE) == gemma.flops_per_image(PAGE) > 0


def test_gemma3_12b_plans_under_16_gib_with_its_tower_resident() -> None:
    """Gemma 3 12B's 21.9 GiB of weights partly offloaded, its 0.42B-parameter tower kept on
    the 16 GiB GPU, 256 tokens per page."""
    gemma = resolve_model_spec("google/gemma-3-12b-it")
    workload = WorkloadSpec(64, 8, images_per_request=1, pixels_per_image=PAGE)
    kwargs = dict(gpu_mem=16 * GiB, allow_compression=False, allow_cpu_attention=False)
    result = search(gemma, workload, FLEXGEN_T4, **kwargs)  # type: ignore[arg-type]
    assert result.estimate.fits and result.estimate.peak_bytes["gpu"] <= 16 * GiB
    report = format_report(gemma, workload, result, {})
    assert "vision tower: 0.42B parameters, 803.5 MiB of weights, home gpu" in report
    assert "per image: 256 tokens" in report
