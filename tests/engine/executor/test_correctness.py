"""Greedy output equals transformers' generate() token for token, under every placement."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from policy import Policy
from tests.engine.tiny_models import MAX_TOKENS

PLACEMENTS: dict[str, dict[str, object]] = {
    "all-on-device": {},
    "weights-cpu-disk": dict(weights_frac=(0.0, 0.5, 0.5)),
    "weights-split-3": dict(weights_frac=(0.3, 0.3, 0.4)),
    "kv-cpu-cpu-attention": dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True),
    "kv-cpu-no-cpu-attention": dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=False),
    "kv-act-disk": dict(kv_frac=(0.0, 0.0, 1.0), act_frac=(0.0, 0.0, 1.0)),
    "kv-act-mixed": dict(kv_frac=(0.4, 0.3, 0.3), act_frac=(0.3, 0.3, 0.4), cpu_attention=True),
    "three-gpu-batches": dict(gpu_batch_size=2, num_gpu_batches=3, weights_frac=(0.0, 0.5, 0.5)),
}


def run(model_dir, prompts, policy, tmp_path, **engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    offload = tmp_path / "offload"
    with LLM(str(model_dir), policy=policy, offload_dir=offload, device="cpu", **engine) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_llama_matches_transformers(tiny_model, references, tmp_path, placement, overlap):
    prompts, expected = references("llama")
    policy = Policy(overlap=overlap, **PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model("llama"), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed", "three-gpu-batches"])
def test_packed_attention_matches_transformers(tiny_model, references, tmp_path, placement):
    """With paged attention off, every past row is gathered into a packed copy first."""
    prompts, expected = references("llama")
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    got = run(tiny_model("llama"), prompts, policy, tmp_path, paged_attention=False)
    assert got == expected


@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed"])
def test_portable_cpu_path_matches_transformers(tiny_model, references, tmp_path, placement):
    """With the native decode kernel and prepacked weights off: SDPA over a gathered copy and
    `F.linear` over plain weights (what runs where no compiler is at hand)."""
    prompts, expected = references("llama")
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    got = run(
        tiny_model("llama"), prompts, policy, tmp_path, native_kernels=False, prepack_weights=False
    )
    assert got == expected


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed", "three-gpu-batches"])
def test_opt_matches_transformers(tiny_model, references, tmp_path, placement, overlap):
    prompts, expected = references("opt")
    policy = Policy(overlap=overlap, **PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model("opt"), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral", "mistral-head-dim"])
def test_llama_family_variants(tiny_model, references, tmp_path, kind):
    prompts, expected = references(kind)
    policy = Policy(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.5, 0.5, 0.0), cpu_attention=True)
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected
