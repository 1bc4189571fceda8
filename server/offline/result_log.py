"""`ResultLog`: an append-only JSONL file whose every line is durable once `append` returns.

A process killed mid-write (SIGKILL, power loss) leaves at most one torn line at
the end; opening the log again reads back every whole line and cuts the rest
off, so the next append starts on a clean line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

from server.batch.files import fsync_dir


class ResultLog:
    """One JSONL file of JSON objects, appended to one line at a time (flush + fsync)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = read_back(path)
        """The whole lines that were in the file when it was opened, in file order."""
        self._file: BinaryIO | None = None

    def append(self, line: str) -> None:
        """Write `line` (one JSON object, no newline) and make it durable before returning."""
        if self._file is None:
            is_new = not self.path.exists()
            self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
            if is_new:
                fsync_dir(self.path.parent)
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_back(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON-object line of `path`; a torn or unreadable tail is truncated away."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    keep = 0
    while True:
        end = data.find(b"\n", keep)
        if end < 0:
            break
        try:
            record = json.loads(data[keep:end])
        except (UnicodeDecodeError, json.JSONDecodeError):
            break  # a torn write: this line and anything after it are dropped
        if not isinstance(record, dict):
            break
        records.append(record)
        keep = end + 1
    if keep < len(data):
        os.truncate(path, keep)
    return records
