"""The planner reads LLaVA's CLIP tower and projector: parameters as transformers counts them
(LlavaForConditionalGeneration's vision_tower and multi_modal_projector), 576 tokens per
336-pixel image, and compute for the blocks the projector reads."""

from __future__ import annotations

from typing import Any

import pytest

from policy.catalog import LLAVA_1_5_TOWER, resolve_model_spec
from policy.errors import ModelSpecError
from policy.specs import ModelSpec
from policy.vision import vision_spec
from tests.engine.llava_model import SPEC, TOKENS_PER_IMAGE

PAGE = 1024 * 1024


def _hf_llava_tower_params(config: dict[str, Any]) -> int:
    """transformers' count of a LLaVA's vision_tower and multi_modal_projector (built on the
    meta device: no memory for the 7B's)."""
    import torch
    from transformers import AutoConfig, LlavaForConditionalGeneration

    hf = AutoConfig.for_model("llava", **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(hf)
    parts = (model.model.vision_tower, model.model.multi_modal_projector)
    return sum(p.numel() for part in parts for p in part.parameters())


def test_the_tiny_llava_tower_has_transformers_parameter_count() -> None:
    """The engine tests' checkpoint: 16 tokens per 56-pixel image, its last block unrun."""
    tiny = ModelSpec.from_hf_config(SPEC)
    assert tiny.vision is not None and tiny.model_type == "llama"
    assert tiny.vision.params == _hf_llava_tower_params(SPEC)
    assert tiny.vision.tokens_per_image(PAGE) == TOKENS_PER_IMAGE
    full = ModelSpec.from_hf_config({**SPEC, "vision_feature_select_strategy": "full"}).vision
    assert full is not None and full.tokens_per_image(PAGE) == TOKENS_PER_IMAGE + 1


def test_llava_1_5_7b_is_priced_with_its_clip_tower() -> None:
    """llava-1.5-7b-hf (the catalogue's shape, as its config.json keeps it): 0.30B parameters
    in the tower and projector, 576 tokens per image whatever its pixels; the last of its 24
    blocks is not run (vision_feature_layer -2): 23/24 of the blocks' FLOPs."""
    spec = resolve_model_spec("llava-hf/llava-1.5-7b-hf")
    tower = spec.vision
    assert tower is not None and spec.model_type == "llama"
    config = {
        "vision_config": LLAVA_1_5_TOWER,
        "text_config": {"model_type": "llama", "hidden_size": 4096, "vocab_size": 32064},
        "vision_feature_layer": -2,
    }
    assert tower.params == _hf_llava_tower_params(config) == 303_507_456 + 20_979_712
    assert {tower.tokens_per_image(p) for p in (64, PAGE, 4 * PAGE)} == {576}
    last = vision_spec({**config, "vision_feature_layer": -1}, "llava")
    assert last is not None and last.params == tower.params
    patches, width = 576, tower.hidden_size  # one block: 2 FLOPs a parameter, attention's keys
    block = 2 * patches * tower.block_linear_params + 4 * patches * patches * width
    assert last.flops_per_image(PAGE) - tower.flops_per_image(PAGE) == block


def test_a_feature_layer_list_is_named() -> None:
    with pytest.raises(ModelSpecError, match="vision_feature_layer"):
        ModelSpec.from_hf_config({**SPEC, "vision_feature_layer": [-2, -1]})
