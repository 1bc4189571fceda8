"""gpt-oss's attention sinks: pushed to -1e4 (none), transformers' tokens change and ours
follow (the placements, logits, prefix cache and each other feature: test_moe_giants.py)."""

from __future__ import annotations

import shutil

import torch

from policy import Policy
from tests.engine.executor.test_correctness import run
from tests.engine.tiny_models import GPT_OSS, MAX_TOKENS, hf_greedy


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
