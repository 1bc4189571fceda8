"""Held-out tiny Idefics3 and SmolVLM (a SigLIP-like tower over image tiles, the pixel-shuffle
connector, Llama) through the engine: one image and two images in a chat, each cut into tiles
and a global image, give transformers' greedy tokens and log-probabilities, the prompt written
with the row/column markers as the processor writes it; the same image again is encoded once.
The tower's features equal transformers' `get_image_features`."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.media import VisionSpec
from policy import Policy
from tests.engine.idefics3_model import (
    TOKENS_PER_TILE,
    build_tiny_idefics3,
    hf_idefics3_generate,
    hf_idefics3_prompt,
)
from tests.engine.vision_models import (
    assert_same_answer,
    chosen,
    image_chat,
    image_prompt,
    png_bytes,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = "what is this?"
KINDS = {"idefics3": 2, "smolvlm": 3}
"""Each model type and its processor's longest edge, in tiles (SmolVLM's code is Idefics3's:
its run here is slow-only; tests/server/test_idefics3_chat.py runs it by default)."""


@pytest.fixture(
    scope="module", params=["idefics3", pytest.param("smolvlm", marks=pytest.mark.slow)]
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = str(request.param)
    return build_tiny_idefics3(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, KINDS[kind])


def test_images_in_a_chat_give_transformers_greedy_tokens(model_dir: Path) -> None:
    image, other = png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)
    want_ids, *want = hf_idefics3_generate(model_dir, [image], TEXT, GREEDY.max_tokens)
    want_pair_ids, *want_pair = hf_idefics3_generate(model_dir, [image, other], TEXT, 6)
    with LLM(str(model_dir), policy=Policy(), device="cpu") as llm:
        assert llm.executor.vision is not None
        spec = VisionSpec.from_model_dir(model_dir)
        assert spec is not None and spec.tiling is not None and not spec.bidirectional
        ids, media = image_prompt(llm, model_dir, [image], TEXT)
        assert ids == want_ids  # the processor's prompt: tiles, markers, merged newlines
        assert media is not None
        rows, cols = media.images[0].grid[1:]
        assert rows * cols > 1  # split into tiles, and a global image after them
        assert len(media.images[0].runs) == rows * cols + 1
        assert sum(n for _, n in media.images[0].runs) == (rows * cols + 1) * TOKENS_PER_TILE
        pair_ids, pair_media = image_prompt(llm, model_dir, [image, other], TEXT)
        assert pair_ids == want_pair_ids
        outs = llm.generate([ids, pair_ids], GREEDY, media=[media, pair_media])
        for out, (tokens, logprobs) in zip(outs, (want, want_pair), strict=True):
            got = out.outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (tokens, logprobs))
        assert llm.executor.vision.num_encoded == 2  # the image in both prompts: once


def test_the_tower_gives_transformers_image_features(model_dir: Path) -> None:
    """Every tile of an image through the tower and the connector, against transformers'
    `get_image_features` over the processor's pixels (bucketed positions, pixel shuffle)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from engine.loading.checkpoint import open_reader
    from engine.models.hf_config import model_config_fields
    from engine.models.idefics3 import Idefics3VisionTower, vision_weight_name

    inputs = hf_idefics3_prompt(model_dir, [png_bytes(90, 50, seed=3)])
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        features = model.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"], return_dict=True
        )
    want = torch.cat(list(features.pooler_output))
    reader = open_reader(model_dir)
    weights = {vision_weight_name(n): reader.get(n) for n in reader.names}
    weights.pop(None, None)
    tower = Idefics3VisionTower(model_config_fields(model.config)["vision"])
    with torch.no_grad():
        got = tower.encode(weights, inputs["pixel_values"][0])  # type: ignore[arg-type]
    assert got.shape == want.shape == (inputs["pixel_values"].shape[1] * TOKENS_PER_TILE, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [True, False])
def test_tiles_and_prompts_are_the_processors(model_dir: Path, tmp_path: Path, split: bool) -> None:
    """Images of many sizes and aspects: the daemon's tile grid and widened prompt equal the
    processor's rows, columns and prompt (do_image_splitting off: the global image alone)."""
    import io
    import json
    import shutil

    from PIL import Image
    from transformers import AutoImageProcessor

    from engine.core.media import expand_image_tokens
    from engine.core.tokenizer import Tokenizer

    root = tmp_path / "checkpoint"  # the processor files and config; no weights needed
    shutil.copytree(model_dir, root, ignore=shutil.ignore_patterns("*.safetensors"))
    # the image processor's config: nested in processor_config.json where that is saved
    # (transformers reads it first; Idefics3's here), else preprocessor_config.json
    if (root / "processor_config.json").is_file():
        nested = json.loads((root / "processor_config.json").read_text())
        nested["image_processor"]["do_image_splitting"] = split
        (root / "processor_config.json").write_text(json.dumps(nested))
    else:
        config = json.loads((root / "preprocessor_config.json").read_text())
        config["do_image_splitting"] = split
        (root / "preprocessor_config.json").write_text(json.dumps(config))
    spec = VisionSpec.from_model_dir(root)
    assert spec is not None and spec.tiling is not None
    processor = AutoImageProcessor.from_pretrained(root)
    tokenizer = Tokenizer(root)
    for width, height in ((60, 90), (130, 40), (56, 56), (500, 20), (3, 200), (112, 57)):
        picture = Image.new("RGB", (width, height))
        out = processor([[picture]], return_row_col_info=True)
        assert spec.grid(width, height)[1:] == (out["rows"][0][0], out["cols"][0][0])
    images = [png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)]
    ids = tokenizer.apply_chat_template(image_chat(TEXT, len(images)))
    sizes = [Image.open(io.BytesIO(b)).size for b in images]
    media = expand_image_tokens(ids, spec, [(b, w, h) for b, (w, h) in zip(images, sizes)])
    assert ids == hf_idefics3_prompt(root, images, TEXT)["input_ids"][0].tolist()
    assert media is not None and (media.images[0].grid == (1, 0, 0)) == (not split)
