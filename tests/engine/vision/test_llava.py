"""A held-out tiny LLaVA (CLIP tower, MLP projector, Llama) through the engine: one image and
two images in a chat give transformers' greedy tokens and log-probabilities, the prompt
widened as LlavaProcessor widens it; the same image again is encoded once. The tower reads
other feature layers and the 'full' strategy as transformers; what it does not run is
refused by name. On the tier the plan or `--vision-tier` picks: homed and run on the host,
the same greedy tokens; in a rehearsal of the CUDA path the tower's weights are device bytes
on the "gpu" tier and none on the "cpu" one."""

from __future__ import annotations

from pathlib import Path

import pytest

from base.errors import UserError
from engine import LLM, SamplingParams
from engine.core.engine_args import EngineArgs
from engine.core.media import VisionSpec
from policy import Policy
from tests.engine.llava_model import SPEC, TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_generate
from tests.engine.vision_models import assert_same_answer, chosen, image_prompt, png_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = "what is this?"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def test_images_in_a_chat_give_transformers_greedy_tokens(llava_dir: Path) -> None:
    image, other = png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)
    want_ids, *want = hf_llava_generate(llava_dir, [image], TEXT, GREEDY.max_tokens)
    want_pair_ids, *want_pair = hf_llava_generate(llava_dir, [image, other], TEXT, 6)
    with LLM(str(llava_dir), policy=Policy(), device="cpu") as llm:
        assert llm.executor.vision is not None
        spec = VisionSpec.from_model_dir(llava_dir)
        assert spec is not None and not spec.bidirectional  # causal, as Llama's text
        ids, media = image_prompt(llm, llava_dir, [image], TEXT)
        assert ids == want_ids  # the processor's prompt: <image> widened to 16 tokens
        assert media is not None and media.images[0].num_tokens == TOKENS_PER_IMAGE
        pair_ids, pair_media = image_prompt(llm, llava_dir, [image, other], TEXT)
        assert pair_ids == want_pair_ids
        outs = llm.generate([ids, pair_ids], GREEDY, media=[media, pair_media])
        for out, (tokens, logprobs) in zip(outs, (want, want_pair), strict=True):
            got = out.outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (tokens, logprobs))
        assert llm.executor.vision.num_encoded == 2  # the image in both prompts: once


@pytest.mark.parametrize(("layer", "strategy"), [(-1, "full"), (-3, "default")])
def test_the_tower_reads_the_feature_layer_and_strategy_as_transformers(
    layer: int, strategy: str
) -> None:
    """Features of one image against transformers' `get_image_features` for the last block's
    states with the class token kept, and the first block's without it (no checkpoint
    written: the weights are the model's own in memory)."""
    import torch
    from transformers import AutoConfig, LlavaForConditionalGeneration

    from engine.models.gemma3_vision import vision_weight_name
    from engine.models.hf_config import model_config_fields
    from engine.models.llava import LlavaVisionTower

    spec = {k: v for k, v in SPEC.items() if k != "model_type"}
    spec |= {"vision_feature_layer": layer, "vision_feature_select_strategy": strategy}
    hf = AutoConfig.for_model("llava", **spec)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(hf).eval()
    vision = model_config_fields(hf)["vision"]
    assert vision.tokens_per_image == TOKENS_PER_IMAGE + (strategy == "full")
    weights = {}
    for name, tensor in model.state_dict().items():
        local = vision_weight_name(name)
        if local is not None:
            weights[local] = tensor + 0.1 * torch.randn_like(tensor)  # no constant norms
    model.load_state_dict(
        {n: weights.get(vision_weight_name(n) or "", t) for n, t in model.state_dict().items()}
    )
    pixels = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        want = model.model.get_image_features(pixels, return_dict=True).pooler_output[0]
        got = LlavaVisionTower(vision).encode(weights, pixels[0])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
        ({"text_config": {**SPEC["text_config"], "model_type": "mistral"}}, "a mistral language"),
    ],
)
def test_what_the_tower_does_not_run_is_refused_by_name(
    change: dict[str, object], refused: str
) -> None:
    from transformers import AutoConfig

    from engine.models.hf_config import UnsupportedModelError, model_config_fields

    spec = {k: v for k, v in SPEC.items() if k != "model_type"} | change
    with pytest.raises(UnsupportedModelError, match=refused):
        model_config_fields(AutoConfig.for_model("llava", **spec))


def test_the_tower_on_the_host_gives_transformers_greedy_tokens(llava_dir: Path) -> None:
    """`vision_tier="cpu"` over a policy that says "gpu": the tower's weights and cache are
    host tensors, the image's features copied into the batch as it is staged."""
    import torch

    image = png_bytes(60, 90, seed=1)
    want_ids, *want = hf_llava_generate(llava_dir, [image], TEXT, GREEDY.max_tokens)
    with LLM(str(llava_dir), policy=Policy(), device="cpu", vision_tier="cpu") as llm:
        vision = llm.executor.vision
        assert llm.policy.vision_tier == "cpu" and vision is not None
        assert vision.device == torch.device("cpu")
        assert {w.device for w in vision.weights.values()} == {torch.device("cpu")}
        ids, media = image_prompt(llm, llava_dir, [image], TEXT)
        assert ids == want_ids
        got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
        assert_same_answer(got.token_ids, chosen(got.logprobs), tuple(want))  # type: ignore[arg-type]
        assert vision.num_encoded == 1


def test_the_switch_overrides_the_policy_and_is_checked(llava_dir: Path) -> None:
    given = Policy(vision_tier="cpu")
    assert EngineArgs(policy=given).resolve_policy(llava_dir)[0].vision_tier == "cpu"
    forced = EngineArgs(policy=given, vision_tier="gpu").resolve_policy(llava_dir)[0]
    assert forced.vision_tier == "gpu"
    with pytest.raises(UserError, match="vision_tier must be auto, gpu or cpu"):
        EngineArgs(vision_tier="disk")


def test_a_rehearsal_holds_the_tower_on_the_device_only_on_the_gpu_tier(llava_dir: Path) -> None:
    """The CUDA path rehearsed (engine/rehearsal.py): the tower's weights are counted on the
    device with `vision_tier` "gpu" (its parameters in float16), none with "cpu", and the
    KV pool is what the tower left of the budget."""
    from engine.rehearsal import rehearse
    from policy.specs import ModelSpec

    spec = ModelSpec.from_hf_config(SPEC)
    assert spec.vision is not None
    found = {
        tier: rehearse(
            llava_dir,
            Policy(gpu_batch_size=1, vision_tier=tier),
            gpu_mem=1 << 30,
            cpu_mem=1 << 30,
            prompt_len=4,
            gen_len=1,
            warmup=False,
        )
        for tier in ("gpu", "cpu")
    }
    assert all(r.ok for r in found.values())
    assert found["gpu"].label_peaks["vision tower"] == spec.vision.params * 2
    assert found["cpu"].label_peaks.get("vision tower", 0) == 0
    assert found["gpu"].label_peaks["weights"] == found["cpu"].label_peaks["weights"]
    # the tower's pages of KV move with it: off the device's pool, into the host's
    pages = {tier: found[tier].kv_capacity_pages for tier in found}
    moved = pages["cpu"]["gpu"] - pages["gpu"]["gpu"]
    assert moved == pages["gpu"]["cpu"] - pages["cpu"]["cpu"]
    assert abs(moved - spec.vision.params * 2 / found["gpu"].kv_page_bytes) < 1
