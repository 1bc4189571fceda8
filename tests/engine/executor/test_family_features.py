"""What the newer families' tests stand on: each config feature changes transformers' tokens on
the test prompts (so the greedy tests in test_families.py would catch it missing), our logits
equal transformers' full forward pass (soft-capped logits included, which greedy tokens cannot
show), and 4-bit weights and KV stay within their measured tolerance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core.engine_args import EngineArgs
from engine.executor.executor import Executor
from policy import Policy
from tests.engine.tiny_models import (
    MAX_TOKENS,
    NEW_FAMILIES,
    STEPWISE,
    TINY_CONFIGS,
    hf_greedy,
    hf_greedy_stepwise,
    hf_reference,
    random_prompts,
)

FEATURES: list[tuple[str, str, Any]] = [
    ("qwen3", "sliding_window", 4096),
    ("gemma2", "sliding_window", 4096),
    ("gemma2", "attn_logit_softcapping", None),
    ("gemma2", "query_pre_attn_scalar", 16),
    ("gemma3", "sliding_window", 4096),
    ("gemma3", "query_pre_attn_scalar", 16),
    ("gemma3", "rope_parameters.sliding_attention.rope_theta", 1000000.0),
    ("gemma3", "rope_parameters.full_attention", {"rope_type": "default", "rope_theta": 1e6}),
    ("phi3", "sliding_window", None),
    ("phi3", "rope_parameters.short_factor", [1.0] * 6),
    ("phi3-long", "rope_parameters.long_factor", [1.0] * 8),
]
"""(kind, config field (dotted: inside a dict), a value that turns the feature off)."""


def _with_config(model_dir: Path, dest: Path, field: str, value: Any) -> Path:
    """A copy of the checkpoint in `model_dir` with one config field changed."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    *path, last = field.split(".")
    target = config
    for key in path:
        target = target[key]
    target[last] = value
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("kind", "field", "value"), FEATURES)
def test_each_feature_changes_transformers_tokens(
    tiny_model, references, tmp_path, kind, field, value
):
    prompts, expected = references(kind)
    changed = _with_config(tiny_model(kind), tmp_path / "changed", field, value)
    reference = hf_greedy_stepwise if kind in STEPWISE else hf_greedy
    assert [reference(changed, p, MAX_TOKENS) for p in prompts] != expected


def assert_changed_feature_followed(
    model_dir: Path,
    reference: tuple[list[list[int]], list[list[int]]],
    field: str,
    value: Any,
    tmp_path: Path,
) -> None:
    """With config `field` set to `value` (a feature turned off), transformers' greedy tokens
    differ from `reference` (prompts, its tokens before), so a test would see the feature
    ignored, and ours equal its new ones."""
    from tests.engine.executor.test_correctness import run

    prompts, expected = reference
    changed = _with_config(model_dir, tmp_path / "changed", field, value)
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs


def _score(model_dir: Path, prompts: list[list[int]], **policy: Any) -> list[torch.Tensor]:
    executor = Executor(EngineArgs(model=str(model_dir), device="cpu"), Policy(**policy))
    try:
        return executor.score(prompts, prefill_len=12)  # the rest one token a step
    finally:
        executor.close()


def _prompts(kind: str, longest: int = 40) -> list[list[int]]:
    vocab = int(TINY_CONFIGS[kind]["vocab_size"])  # type: ignore[call-overload]
    return random_prompts(3, vocab, longest - 8, longest, seed=11)


@pytest.mark.parametrize("kind", [*NEW_FAMILIES, "phi3-long"])
def test_logits_equal_transformers_full_forward(tiny_model, kind):
    """Teacher-forced: transformers' one forward pass over each sequence against our prefill of
    its first 12 tokens and then one decode per token (windows, caps, rotary all read back from
    the KV cache). phi3-long stays within its original length, where transformers' single
    forward pass uses the short factors as every step of ours does."""
    assert_logits_equal_transformers(tiny_model(kind), kind, 32 if kind == "phi3-long" else 40)


def assert_logits_equal_transformers(model_dir: Path, kind: str, longest: int = 40) -> None:
    """Our logits (prefill of 12 tokens, then one decode per token) on 3 prompts of
    `longest` - 8 to `longest` tokens equal transformers' one forward pass within 2e-5."""
    prompts = _prompts(kind, longest)
    model = hf_reference(model_dir)
    for prompt, got in zip(prompts, _score(model_dir, prompts), strict=True):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def divergence(base: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(base || got) per position in nats, max absolute logit error)."""
    kl = [
        float(F.kl_div(g.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum"))
        for b, g in zip(base, got, strict=True)
    ]
    positions = sum(b.shape[0] for b in base)
    return sum(kl) / positions, max(
        float((b - g).abs().max()) for b, g in zip(base, got, strict=True)
    )


COMPRESSED = {"kv": (dict(compress_kv=True), 0.1), "weights": (dict(compress_weights=True), 0.3)}
"""name -> (policy, largest mean KL divergence from the float32 path), measured over these
families' tiny checkpoints (docs/compression.md gives the figures: top-1 agreement means
little on their nearly flat, soft-capped logits)."""


def assert_four_bit_within_tolerance(model_dir: Path, kind: str, compressed: str) -> None:
    """The `compressed` path's mean KL divergence from the float32 path within its bound."""
    policy, max_kl = COMPRESSED[compressed]
    prompts = _prompts(kind)
    base = _score(model_dir, prompts)
    kl, err = divergence(base, _score(model_dir, prompts, **policy))
    assert kl <= max_kl, f"mean KL divergence {kl:.4f}"
    assert err > 0.0  # the compressed path ran


@pytest.mark.parametrize("compressed", list(COMPRESSED))
@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_four_bit_within_tolerance(tiny_model, kind, compressed):
    assert_four_bit_within_tolerance(tiny_model(kind), kind, compressed)
