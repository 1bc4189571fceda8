"""Images through the CUDA path: a tiny Gemma 3 (SigLIP tower, both-ways attention inside an
image), a tiny LLaVA (CLIP tower) and a tiny Idefics3 (image tiles, their markers between
the image rows) on the GPU, with CUDA graphs on and off, give the tokens
transformers gives on the CPU. With graphs on, a prefill step at a captured size replays its
embedding (`GraphLayer`), and the image rows' features are written into the replayed
embedding's static buffer (`image_rows.embed_images`): only a GPU runs that path. Run with
`pytest -m gpu` (the GPU pass's suite step). The tower homed on the host
(`vision_tier="cpu"`) feeds the GPU the same features."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from policy import Policy
from tests.engine.gemma3_vision_model import build_tiny_gemma3, hf_gemma3_generate
from tests.engine.idefics3_model import build_tiny_idefics3, hf_idefics3_generate
from tests.engine.llava_model import build_tiny_llava, hf_llava_generate
from tests.engine.vision_models import chosen, image_prompt, png_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = "what is this?"
CUDA_LOGPROB_TOLERANCE = 1e-3
"""float32 on the GPU against transformers on the CPU: kernels sum in another order."""

MODELS: dict[str, tuple[Callable[[Path], Path], Callable[..., tuple[list[int], ...]]]] = {
    "gemma3": (build_tiny_gemma3, hf_gemma3_generate),
    "llava": (build_tiny_llava, hf_llava_generate),
    "idefics3": (build_tiny_idefics3, hf_idefics3_generate),
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_images_on_cuda_give_transformers_greedy_tokens(
    kind: str, graphs: bool, tmp_path: Path
) -> None:
    build, reference = MODELS[kind]
    model_dir = build(tmp_path / kind)
    images = [png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)]
    want_ids, tokens, logprobs = reference(model_dir, images, TEXT, GREEDY.max_tokens)
    options = dict(cuda_graphs=graphs, piecewise_graphs=graphs)
    with LLM(str(model_dir), policy=Policy(), device="cuda", dtype="float32", **options) as llm:
        ids, media = image_prompt(llm, model_dir, images, TEXT)
        assert ids == want_ids
        (out,) = llm.generate([ids], GREEDY, media=[media])
    got = out.outputs[0]
    assert got.token_ids == tokens
    worst = max(abs(a - b) for a, b in zip(chosen(got.logprobs), logprobs, strict=True))
    assert worst < CUDA_LOGPROB_TOLERANCE


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_tower_on_the_host_feeds_the_gpu(kind: str, tmp_path: Path) -> None:
    """`vision_tier="cpu"`: the tower's weights and runs on the host, each batch's image rows
    copied to the GPU as it is staged; the same tokens as transformers."""
    build, reference = MODELS[kind]
    model_dir = build(tmp_path / kind)
    images = [png_bytes(60, 90, seed=1)]
    want_ids, tokens, logprobs = reference(model_dir, images, TEXT, GREEDY.max_tokens)
    policy = Policy(vision_tier="cpu")
    with LLM(str(model_dir), policy=policy, device="cuda", dtype="float32") as llm:
        vision = llm.executor.vision
        assert vision is not None
        assert {w.device.type for w in vision.weights.values()} == {"cpu"}
        ids, media = image_prompt(llm, model_dir, images, TEXT)
        assert ids == want_ids
        (out,) = llm.generate([ids], GREEDY, media=[media])
        assert vision.num_encoded == 1
    got = out.outputs[0]
    assert got.token_ids == tokens
    worst = max(abs(a - b) for a, b in zip(chosen(got.logprobs), logprobs, strict=True))
    assert worst < CUDA_LOGPROB_TOLERANCE
