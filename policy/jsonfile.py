"""Reading the project's small JSON records (policies, hardware profiles) with clear errors,
and writing cache files whole."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from base.errors import UserError


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


def publish_file(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` in one step: a temporary sibling renamed into place, so a reader
    (or a process that crashes mid-write) sees the old file or the new one whole. The
    temporary is removed when the write fails; the error (OSError) is the caller's."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; readable as write_text's would be
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
