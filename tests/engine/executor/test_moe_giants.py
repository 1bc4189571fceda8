"""gpt-oss and Llama 4, the newer mixture-of-experts families with layers of their own: greedy
tokens equal transformers' with experts and KV on every tier, logits equal its full forward
pass, the prefix cache and nano-batches give the same tokens, and each feature changes
transformers' own tokens (so the tests would see it ignored). What only one family has is
tested in its own file (test_gpt_oss.py: the sinks changed; test_llama4.py: the vision
checkpoint)."""

from __future__ import annotations

import pytest

from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_family_features import (
    assert_changed_feature_followed,
    assert_logits_equal_transformers,
)
from tests.engine.executor.test_moe import MOE_PLACEMENTS
from tests.engine.executor.test_nano_batches import SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
)
from tests.engine.tiny_models import GPT_OSS, LLAMA4

GIANTS = (GPT_OSS, LLAMA4)
DEFAULT_PLACEMENTS = ("all-on-device", "experts-disk", "kv-act-mixed", "three-gpu-batches")
SLOW_PLACEMENTS = ("weights-cpu", "experts-cpu", "experts-split-3", "kv-act-disk")


def _placements() -> list[object]:
    slow = [*SLOW_PLACEMENTS, "kv-cpu-cpu-attention"]
    return [*DEFAULT_PLACEMENTS, *(pytest.param(p, marks=pytest.mark.slow) for p in slow)]


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", GIANTS)
def test_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", GIANTS)
def test_portable_path_matches_transformers(tiny_model, references, tmp_path, kind):
    """SDPA over gathered rows, or the eager product with sinks (native kernels off): the
    windows, chunks and sinks through the masks and plain ops there, through the native
    kernels' bounds and sink terms in the other tests."""
    prompts, expected = references(kind)
    policy = Policy(**PLACEMENTS["kv-act-mixed"])  # type: ignore[arg-type]
    portable = dict(native_kernels=False, prepack_weights=False)
    assert run(tiny_model(kind), prompts, policy, tmp_path, **portable) == expected


@pytest.mark.parametrize("kind", GIANTS)
def test_logits_equal_transformers_full_forward(tiny_model, kind):
    """Teacher-forced past the windows and chunks: gpt-oss's sinks and clamped experts,
    Llama 4's chunk bounds, temperature and router show in logits."""
    assert_logits_equal_transformers(tiny_model(kind), kind)


@pytest.mark.parametrize("kind", GIANTS)
def test_cached_prefixes_and_nano_batches(tiny_model, references, tmp_path, kind):
    model = tiny_model(kind)
    assert_cached_prefixes_give_transformers_tokens(model, kind, Policy())
    prompts, expected = references(kind)
    policy = Policy(**SHAPE, weights_frac=(0.0, 0.5, 0.5), num_nano_batches=4)
    tokens, layers_run = run_nano(model, prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


FEATURES = [
    (GPT_OSS, "sliding_window", 4096),
    (LLAMA4, "attention_chunk_size", 4096),
    (GPT_OSS, "swiglu_limit", 100.0),
    (GPT_OSS, "rope_parameters.truncate", True),
    (LLAMA4, "attn_temperature_tuning", False),
    (LLAMA4, "use_qk_norm", False),
    (LLAMA4, "no_rope_layers", [1, 1, 1, 1]),
]
"""(kind, config field (dotted: inside a dict), a value that turns the feature off); the first
of each family runs by default. Llama 4's chunk size is also in the layer types its config
was saved with, which stay chunked."""


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [*FEATURES[:2], *(pytest.param(*f, marks=pytest.mark.slow) for f in FEATURES[2:])],
)
def test_each_feature_changes_transformers_tokens(
    tiny_model, references, tmp_path, kind, field, value
):
    assert_changed_feature_followed(tiny_model(kind), references(kind), field, value, tmp_path)
