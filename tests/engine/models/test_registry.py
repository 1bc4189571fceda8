"""The family table (policy/families.py): every row names a real model class and config reader,
and everything the engine, the planner and the GGUF converter know by model type comes from it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from engine.loading.gguf_config import MODEL_TYPES
from engine.loading.gguf_tensors import ARCHITECTURES
from engine.models.base import Model
from engine.models.config_cache import NORMALIZERS
from engine.models.hf_config import SUPPORTED_MODEL_TYPES, TEXT_CONFIGS
from engine.models.registry import implementation_of, reader_of, resolve
from policy.families import ALIASES, FAMILIES, Family, rope_types
from policy.hf_spec import HYBRIDS

ROWS = list(FAMILIES.values())


@pytest.mark.parametrize("row", ROWS, ids=[row.model_type for row in ROWS])
def test_each_row_names_a_model_class_and_a_reader(row: Family) -> None:
    if row.is_vision_wrapper:  # its language model's row builds and reads it
        text = FAMILIES[row.text_config]
        assert not text.is_vision_wrapper and text.implementation and not row.reader
        return
    model_class = implementation_of(row.model_type)
    assert inspect.isclass(model_class) and issubclass(model_class, Model)
    reader = reader_of(row.model_type)
    assert callable(reader) and list(inspect.signature(reader).parameters) == ["hf"]


def test_the_tables_read_by_model_type_come_from_the_rows() -> None:
    """What the engine, the planner and the GGUF converter kept in tables of their own before
    the family table, read from it now."""
    assert SUPPORTED_MODEL_TYPES[:5] == ("opt", "llama", "mistral", "qwen2", "qwen2_5_vl")
    assert len(SUPPORTED_MODEL_TYPES) == 35  # idefics3 and smolvlm among them
    assert TEXT_CONFIGS == {  # Gemma 3 runs its vision tower (engine/models/gemma3_vision.py)
        "llama4": "llama4_text",
        "qwen3_5": "qwen3_5_text",
        "qwen3_5_moe": "qwen3_5_moe_text",
    }
    assert ALIASES == {"kimi_k2": "deepseek_v3"}
    gated_delta = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
    assert {*gated_delta, "granitemoehybrid", "nemotron_h", "falcon_h1"} == HYBRIDS
    assert ARCHITECTURES[:3] == ("llama", "qwen2", "qwen3") and len(ARCHITECTURES) == 15
    assert MODEL_TYPES["gemma3"] == "gemma3_text" and MODEL_TYPES["deepseek2"] == "deepseek_v3"
    assert "llama" not in MODEL_TYPES and "qwen2" not in MODEL_TYPES
    assert rope_types("qwen2_5_vl_text") == rope_types("qwen3_vl_text") == ("default",)


def test_a_name_that_names_nothing_fails_to_resolve() -> None:
    with pytest.raises(AttributeError):
        resolve("engine.models.llama:NoSuchModel")


def test_the_config_cache_is_keyed_by_every_module_a_row_names() -> None:
    """A change to a reader must not be served a record an older reader normalized."""
    named = {row.reader.partition(":")[0] for row in ROWS if row.reader}
    files = {name.replace(".", "/") + ".py" for name in named}
    assert files <= set(NORMALIZERS)
    packages = Path(__file__).resolve().parents[3]
    assert all((packages / name).is_file() for name in NORMALIZERS)
