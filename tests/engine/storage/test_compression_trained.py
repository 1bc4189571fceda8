"""4-bit weights and KV on a trained model (SmolLM2-135M-Instruct): what they cost, measured.

The fixed text and the measure are bench/quality/compression.py's; the tolerances sit just
outside what `python -m bench.quality.compression` measured (docs/compression.md), so a
change that makes either path worse, or turns it into a no-op, fails here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.quality.compression import ONE, compare, score, score_transformers

# measured (docs/compression.md): float perplexity 24.65
WEIGHTS_MIN_TOP1, WEIGHTS_MAX_PPL = 0.60, 42.5  # measured 0.626, 40.64
KV_MIN_TOP1, KV_MAX_PPL = 0.80, 28.5  # measured 0.828, 27.53 (26.9-27.5 over CPU switches)


@pytest.fixture(scope="module")
def float_path(smollm2_dir):
    """The float path, the whole text in one prefill (decode steps give the same logits)."""
    return score(str(smollm2_dir), ONE, step_tokens=None)


def test_float_path_is_transformers(smollm2_dir, float_path):
    expected = score_transformers(str(smollm2_dir))
    assert float_path.top1 == expected.top1
    assert float_path.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_4bit_weights_cost_what_transformers_says_they_cost(smollm2_dir, float_path):
    """The engine's 4-bit weight path is transformers on the same dequantized weights (every
    matrix of the decoder layers and the head, groups of 64 along the output channel), and its
    measured cost on the text stays within the documented tolerance."""
    got = score(str(smollm2_dir), replace(ONE, compress_weights=True), step_tokens=None)
    expected = score_transformers(str(smollm2_dir), weight_group_dim=0)
    assert got.top1 == expected.top1
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-3)
    measured = compare(float_path, got)
    assert measured["top1_agreement"] >= WEIGHTS_MIN_TOP1, measured
    assert compare(float_path, float_path)["perplexity"] < measured["perplexity"] <= WEIGHTS_MAX_PPL


def test_4bit_kv_cost_within_tolerance(smollm2_dir, float_path):
    """One token per step, so every position reads all earlier keys and values back from the
    4-bit cache, as decoding does."""
    got = score(str(smollm2_dir), replace(ONE, compress_kv=True), step_tokens=1)
    measured = compare(float_path, got)
    assert KV_MIN_TOP1 <= measured["top1_agreement"] < 1.0, measured
    assert compare(float_path, float_path)["perplexity"] < measured["perplexity"] <= KV_MAX_PPL
