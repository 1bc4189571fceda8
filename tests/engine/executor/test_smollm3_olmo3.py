"""SmolLM3 (NoPE layers, windows on them) and OLMo 3 (windows on three layers of four, YaRN on
the global ones): greedy tokens equal transformers' under the placements the other families are
tested under, logits equal its full forward pass, the prefix cache gives the same tokens, and
each feature changes transformers' own tokens (so the tests would see it ignored). The default
run keeps a few placements; `-m slow` runs the rest and every attention path."""

from __future__ import annotations

import pytest

from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_families import FAMILY_PLACEMENTS
from tests.engine.executor.test_family_features import (
    _with_config,
    assert_logits_equal_transformers,
)
from tests.engine.executor.test_nano_batches import PLACEMENTS as NANO_PLACEMENTS
from tests.engine.executor.test_nano_batches import SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
)
from tests.engine.tiny_models import DENSE_2025, MAX_TOKENS, hf_greedy

DEFAULT_PLACEMENTS = ("all-on-device", "kv-act-mixed", "three-gpu-batches")


def _placements() -> list[object]:
    slow = [p for p in FAMILY_PLACEMENTS if p not in DEFAULT_PLACEMENTS]
    return [*DEFAULT_PLACEMENTS, *(pytest.param(p, marks=pytest.mark.slow) for p in slow)]


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", DENSE_2025)
def test_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", DENSE_2025)
def test_portable_path_matches_transformers(tiny_model, references, tmp_path, kind):
    """SDPA over gathered rows and `F.linear` (native kernels and prepacking off): the windows
    go through SDPA's mask there, through the native kernels' bound above."""
    prompts, expected = references(kind)
    policy = Policy(**PLACEMENTS["kv-act-mixed"])  # type: ignore[arg-type]
    portable = dict(native_kernels=False, prepack_weights=False)
    assert run(tiny_model(kind), prompts, policy, tmp_path, **portable) == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", DENSE_2025)
def test_every_attention_path_and_nano_batches(tiny_model, references, tmp_path, kind):
    prompts, expected = references(kind)
    model = tiny_model(kind)
    sequential = Policy(overlap=False, **PLACEMENTS["weights-split-3"])  # type: ignore[arg-type]
    assert run(model, prompts, sequential, tmp_path) == expected
    mixed = Policy(**PLACEMENTS["kv-act-mixed"])  # type: ignore[arg-type]
    assert run(model, prompts, mixed, tmp_path, paged_attention=False) == expected
    for placement in ("resident", "mixed-tiers-cpu-attention"):
        policy = Policy(**SHAPE, **NANO_PLACEMENTS[placement], num_nano_batches=4)
        tokens, layers_run = run_nano(model, prompts, policy, tmp_path)
        assert tokens == expected and layers_run > 0


@pytest.mark.parametrize("kind", DENSE_2025)
def test_logits_equal_transformers_full_forward(tiny_model, kind):
    """Teacher-forced: our prefill of 12 tokens and one decode per token after against
    transformers' one forward pass, past the windows (prompts of 32-40 tokens)."""
    assert_logits_equal_transformers(tiny_model(kind), kind)


@pytest.mark.parametrize("kind", DENSE_2025)
def test_cached_prefixes_give_transformers_tokens(tiny_model, kind):
    """A shared 40-token prompt read back from the prefix cache (past the windows)."""
    assert_cached_prefixes_give_transformers_tokens(tiny_model(kind), kind, Policy())


FEATURES = [
    ("smollm3", "no_rope_layers", [1, 1, 1, 1]),
    ("smollm3", "sliding_window", 4096),
    ("olmo3", "sliding_window", 4096),
    ("olmo3", "rope_parameters.full_attention", {"rope_type": "default", "rope_theta": 5e5}),
]
"""(kind, config field (dotted: inside a dict), a value that turns the feature off)."""


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [*FEATURES[::2], *(pytest.param(*f, marks=pytest.mark.slow) for f in FEATURES[1::2])],
)
def test_each_feature_changes_transformers_tokens(
    tiny_model, references, tmp_path, kind, field, value
):
    prompts, expected = references(kind)
    changed = _with_config(tiny_model(kind), tmp_path / "changed", field, value)
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs
