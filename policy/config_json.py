"""The one reader of a checkpoint's config.json, for both layers: the file -> its dict, and the
row of the family table (policy/families.py) its model type names.

The planner prices the dict (policy/hf_spec.py); the engine reads the model type here, then the
same file through the transformers config class of that row (engine/models/config.py), whose
defaults and renames it needs to decide what runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from policy.errors import ModelSpecError
from policy.families import ALIASES


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a `ModelSpecError` says why there is none."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ModelSpecError(f"cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path} must hold a JSON object")
    return data


def model_type_of(config: dict[str, Any]) -> str:
    """The config's model type as the family table names it: a type another row aliases (Kimi
    K2's, DeepSeek-V3's architecture) read as that row's."""
    model_type = str(config.get("model_type", "")).lower()
    return ALIASES.get(model_type, model_type)
