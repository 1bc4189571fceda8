"""gpt-oss: attention sinks per head, sliding and full layers alternating, YaRN, and its own
mixture of experts (biased router and experts, interleaved gate/up, clamped SwiGLU): greedy
tokens equal transformers' with experts and KV on every tier, logits equal its full forward
pass, the prefix cache gives the same tokens, and each feature changes transformers' own
tokens (so the tests would see it ignored)."""

from __future__ import annotations

import shutil

import pytest
import torch

from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_family_features import (
    _with_config,
    assert_logits_equal_transformers,
)
from tests.engine.executor.test_moe import MOE_PLACEMENTS
from tests.engine.executor.test_nano_batches import SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
)
from tests.engine.tiny_models import GPT_OSS, MAX_TOKENS, hf_greedy

DEFAULT_PLACEMENTS = ("all-on-device", "experts-disk", "kv-act-mixed", "three-gpu-batches")


def _placements() -> list[object]:
    slow = ["weights-cpu", "experts-cpu", "experts-split-3", "kv-act-disk"]
    slow.append("kv-cpu-cpu-attention")
    return [*DEFAULT_PLACEMENTS, *(pytest.param(p, marks=pytest.mark.slow) for p in slow)]


@pytest.mark.parametrize("placement", _placements())
def test_matches_transformers(tiny_model, references, tmp_path, placement):
    prompts, expected = references(GPT_OSS)
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}[placement])  # type: ignore[arg-type]
    assert run(tiny_model(GPT_OSS), prompts, policy, tmp_path) == expected


def test_logits_equal_transformers_full_forward(tiny_model):
    """Teacher-forced, past the windows: the sinks and the clamped experts show in logits."""
    assert_logits_equal_transformers(tiny_model(GPT_OSS), GPT_OSS)


def test_cached_prefixes_and_nano_batches(tiny_model, references, tmp_path):
    model = tiny_model(GPT_OSS)
    assert_cached_prefixes_give_transformers_tokens(model, GPT_OSS, Policy())
    prompts, expected = references(GPT_OSS)
    policy = Policy(**SHAPE, weights_frac=(0.0, 0.5, 0.5), num_nano_batches=4)
    tokens, layers_run = run_nano(model, prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


def test_sinks_change_transformers_tokens(tiny_model, references, tmp_path):
    """Sinks pushed to -1e4 (no sink) change transformers' tokens; ours follow."""
    from safetensors.torch import load_file, save_file

    prompts, expected = references(GPT_OSS)
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model(GPT_OSS), changed)
    state = load_file(str(changed / "model.safetensors"))
    for name in state:
        if name.endswith("sinks"):
            state[name] = torch.full_like(state[name], -1e4)
    save_file(state, str(changed / "model.safetensors"))
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs


FEATURES = [
    ("sliding_window", 4096),
    ("swiglu_limit", 100.0),
    ("rope_parameters.truncate", True),
]
"""(config field (dotted: inside a dict), a value that turns the feature off)."""


@pytest.mark.parametrize(
    ("field", "value"),
    [FEATURES[0], *(pytest.param(*f, marks=pytest.mark.slow) for f in FEATURES[1:])],
)
def test_each_feature_changes_transformers_tokens(tiny_model, references, tmp_path, field, value):
    prompts, expected = references(GPT_OSS)
    changed = _with_config(tiny_model(GPT_OSS), tmp_path / "changed", field, value)
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs
