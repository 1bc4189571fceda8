"""Qwen 3, Gemma 2, Gemma 3, Phi-3/4 and OLMo 2: greedy tokens equal transformers' under the
placements and switches the Llama family is tested under (tests/engine/executor/
test_correctness.py, test_nano_batches.py; test_prefix_caching.py runs them too), with windows
short enough to bite within the prompts."""

from __future__ import annotations

import pytest

from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_nano_batches import PLACEMENTS as NANO_PLACEMENTS
from tests.engine.executor.test_nano_batches import SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.tiny_models import NEW_FAMILIES

FAMILY_PLACEMENTS = [
    "all-on-device",
    "weights-cpu-disk",
    "kv-cpu-cpu-attention",
    "kv-cpu-no-cpu-attention",
    "kv-act-disk",
    "kv-act-mixed",
    "three-gpu-batches",
]


@pytest.mark.parametrize("placement", FAMILY_PLACEMENTS)
@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_family_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_family_on_every_attention_path(tiny_model, references, tmp_path, kind):
    """The plain sequential loop; every past row gathered into a packed copy (paged attention
    off); SDPA and `F.linear` where the native CPU kernels and prepacked weights are off."""
    prompts, expected = references(kind)
    mixed = PLACEMENTS["kv-act-mixed"]
    model = tiny_model(kind)
    sequential = Policy(overlap=False, **PLACEMENTS["weights-split-3"])  # type: ignore[arg-type]
    assert run(model, prompts, sequential, tmp_path) == expected
    policy = Policy(**mixed)  # type: ignore[arg-type]
    assert run(model, prompts, policy, tmp_path, paged_attention=False) == expected
    portable = dict(native_kernels=False, prepack_weights=False)
    assert run(model, prompts, Policy(), tmp_path, **portable) == expected
    assert run(model, prompts, policy, tmp_path, **portable) == expected


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_family_with_nano_batches(tiny_model, references, tmp_path, kind):
    prompts, expected = references(kind)
    for placement in ("resident", "mixed-tiers-cpu-attention"):
        policy = Policy(**SHAPE, **NANO_PLACEMENTS[placement], num_nano_batches=4)
        tokens, layers_run = run_nano(tiny_model(kind), prompts, policy, tmp_path)
        assert tokens == expected and layers_run > 0


@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed", "three-gpu-batches"])
def test_longrope_switches_to_its_long_factors(tiny_model, references, tmp_path, placement):
    """Phi-3's LongRoPE past original_max_position_embeddings (32 here): the rows from there
    on rotate with the long factors (the reference steps transformers' model over its cache;
    tests/engine/tiny_models.py: STEPWISE says why not generate())."""
    prompts, expected = references("phi3-long")
    assert max(map(len, prompts)) + len(expected[0]) > 32  # the switch is crossed
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model("phi3-long"), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed", "three-gpu-batches"])
def test_gemma3_with_a_vision_tower_runs_its_language_model(
    tiny_model, references, tmp_path, placement
):
    """Gemma 3 4B and larger ship as one checkpoint with a vision tower (model type gemma3):
    its language model, read from under `model.language_model.`, gives the tokens
    transformers' Gemma3ForConditionalGeneration gives for a text prompt."""
    prompts, expected = references("gemma3-vision")
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model("gemma3-vision"), prompts, policy, tmp_path) == expected
