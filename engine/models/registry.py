"""The engine's side of the family table (policy/families.py): a row's 'module:attribute' names
-> the model class and the config reader they name, imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from policy.families import FAMILIES


def resolve(name: str) -> Any:
    """The attribute a 'package.module:attribute' name names (its module imported)."""
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def implementation_of(model_type: str) -> type:
    """The layer-wise model class (an `engine.models.base.Model`) of `model_type` (a row with
    an implementation; `build_model` builds it)."""
    implementation: type = resolve(FAMILIES[model_type].implementation)
    return implementation


def reader_of(model_type: str) -> Callable[[Any], dict[str, Any]]:
    """The function from a transformers config of `model_type` to `ModelConfig` fields."""
    reader: Callable[[Any], dict[str, Any]] = resolve(FAMILIES[model_type].reader)
    return reader
