"""`read_model_config`: a config file is read through transformers once, then from the cache,
to the same `ModelConfig` (one tiny family of each kind of field); a changed file, an
unreadable record or `NANOFLEX_CONFIG_CACHE=0` reads afresh."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from engine.models import config_cache
from engine.models.config import ModelConfig, read_hf_config
from tests.engine.tiny_models import TINY_CONFIGS

KINDS = (
    "opt",
    "llama3",
    "phi3-long",
    "gemma3",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "qwen3_next",
    "nemotron_h",
    "falcon_h1",
)
"""One family of each kind of field: rotary scaling dicts with lists (llama3, longrope),
per-layer tuples (windows, dense, NoPE, state and MLP layers), Falcon-H1's multipliers."""


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """The directories read through transformers, in a cache of this test's own."""
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(config_cache.ENV, raising=False)
    reads: list[Path] = []

    def read(model_dir: Path) -> Any:
        reads.append(model_dir)
        return read_hf_config(model_dir)

    monkeypatch.setattr(config_cache, "read_hf_config", read)
    return reads


def write_config(kind: str, path: Path, **changes: Any) -> Path:
    spec = {**TINY_CONFIGS[kind], **changes}
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(path)
    return path


def test_each_kind_of_field_reads_back_from_the_cache_as_it_was_read(
    counted: list[Path], tmp_path: Path
) -> None:
    for kind in KINDS:
        model_dir = write_config(kind, tmp_path / kind)
        first = config_cache.read_model_config(model_dir)
        assert first == ModelConfig.from_hf(read_hf_config(model_dir)), kind
        again = config_cache.read_model_config(model_dir)
        assert again == first, kind
        assert type(again.multipliers.ssm_zxbcdt) is tuple, kind
    assert counted == [tmp_path / kind for kind in KINDS]  # each read once


def test_a_changed_or_damaged_record_or_the_switch_reads_afresh(
    counted: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = write_config("qwen3", tmp_path / "model")
    assert config_cache.read_model_config(model_dir).num_layers == 3
    write_config("qwen3", model_dir, num_hidden_layers=2)
    assert config_cache.read_model_config(model_dir).num_layers == 2
    assert len(counted) == 2
    path = config_cache._cache_path(model_dir)
    assert path is not None and path.is_file()
    path.write_text("{not json")
    assert config_cache.read_model_config(model_dir).num_layers == 2
    assert len(counted) == 3
    assert config_cache.read_model_config(model_dir).num_layers == 2  # rewritten whole
    assert len(counted) == 3
    monkeypatch.setenv(config_cache.ENV, "0")
    assert config_cache.read_model_config(model_dir).num_layers == 2
    assert len(counted) == 4


def test_a_cached_read_logs_what_the_first_read_logged(
    counted: list[Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = write_config("qwen3_5-vision", tmp_path / "model")
    messages = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanoflex.engine"):
            config_cache.read_model_config(model_dir)
        messages.append([r.getMessage() for r in caplog.records])
    assert len(counted) == 1
    notice = "the vision tower is not loaded; nanoflex runs its qwen3_5_text language model"
    assert messages[0] == messages[1] == [f"qwen3_5: {notice} on text"]
