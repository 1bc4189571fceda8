"""The planner reads Idefics3's and SmolVLM's tower: its parameters equal transformers' count
(the tiny test checkpoint's and SmolVLM-256M's, the catalogue's shape), and an image's tokens
are its tiles' and its global image's whatever its pixels."""

from __future__ import annotations

from typing import Any

import pytest

from policy.catalog import SMOLVLM_TOWER, resolve_model_spec
from policy.specs import ModelSpec

PAGE = 1024 * 1024


def _hf_tower_params(config: dict[str, Any]) -> int:
    """transformers' count of Idefics3's vision model and connector (on the meta device)."""
    import torch
    from transformers import Idefics3Config
    from transformers.models.idefics3.modeling_idefics3 import (
        Idefics3Connector,
        Idefics3VisionTransformer,
    )

    full = Idefics3Config(**config)
    with torch.device("meta"):
        parts = (
            Idefics3VisionTransformer._from_config(full.vision_config),
            Idefics3Connector(full),
        )
    return sum(p.numel() for part in parts for p in part.parameters())


def test_the_tiny_tower_has_transformers_parameter_count() -> None:
    from tests.engine.idefics3_model import TOKENS_PER_TILE, spec

    config = spec("idefics3")
    tiny = ModelSpec.from_hf_config(config)
    assert tiny.vision is not None and tiny.model_type == "llama"
    assert tiny.vision.params == _hf_tower_params(config)
    # the processor's default longest edge, 4 tiles: 4 x 4 tiles and the global image
    assert {tiny.vision.tokens_per_image(p) for p in (64, PAGE)} == {17 * TOKENS_PER_TILE}


@pytest.mark.parametrize("name", ["smolvlm-256m-instruct", "smolvlm-500m-instruct"])
def test_smolvlm_is_priced_with_its_tower(name: str) -> None:
    spec = resolve_model_spec(name)
    assert spec.vision is not None and spec.model_type == "llama"
    config = {
        "vision_config": SMOLVLM_TOWER,
        "text_config": {"hidden_size": spec.hidden_size},
        "scale_factor": 4,
    }
    assert spec.vision.params == _hf_tower_params(config)
    assert spec.vision.tokens_per_image(PAGE) == 17 * 64  # 2048 px: 4 x 4 tiles of 512, + 1
    assert spec.vision.patches_per_image(PAGE) == 17 * 32 * 32
