"""Reading the project's small JSON records (policies, hardware profiles) with clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from policy.errors import UserError


def parse_object(text: str, what: str, error: type[UserError]) -> dict[str, Any]:
    """`text` as a JSON object, or `error` saying what is wrong with the `what`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object")
    return data


def read_text(path: str | Path, what: str, error: type[UserError]) -> str:
    try:
        return Path(path).expanduser().read_text()
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from e
