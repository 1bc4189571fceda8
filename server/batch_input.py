"""Validation of a Batch API input file, line by line, with OpenAI's error codes.

A valid line is `{"custom_id": str, "method": "POST", "url": <the batch's endpoint>,
"body": {...}}`. Broken, duplicate and wrong-url lines become error-file lines
while the other lines run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, BinaryIO

from server.json_body import JSONBodyError, loads_json

ErrorLine = Callable[[str | None, str, str], str]
Row = tuple[int, str | None, str | None, str, str | None]
"""(line_index, custom_id, body JSON, status 'pending' | 'failed', error line JSON)."""


def _check(obj: Any, endpoint: str, seen: set[str]) -> tuple[str, str] | None:
    """(code, message) of the first problem with a decoded line, None if it is valid."""
    if not isinstance(obj, dict):
        return "invalid_request", "Each line must be a JSON object."
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "Each line needs a non-empty string 'custom_id'."
    if custom_id in seen:
        return (
            "duplicate_custom_id",
            f"custom_id {custom_id!r} is used by an earlier line; custom_ids must be unique.",
        )
    if obj.get("method") != "POST":
        return "invalid_method", "'method' must be 'POST'."
    if obj.get("url") != endpoint:
        return (
            "invalid_url",
            f"'url' is {obj.get('url')!r}, but this batch's endpoint is {endpoint!r}.",
        )
    if not isinstance(obj.get("body"), dict):
        return "invalid_body", "'body' must be a JSON object with the request."
    return None


def parse_input_lines(
    f: BinaryIO, endpoint: str, error_line: ErrorLine
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Rows for every non-blank line in file order, and the problems as OpenAI batch errors."""
    rows: list[Row] = []
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for line_number, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        index = len(rows)
        obj: Any = None
        try:
            obj = loads_json(raw)
            problem = _check(obj, endpoint, seen)
        except JSONBodyError as e:
            problem = ("invalid_json_line", f"Line {line_number} is not valid JSON: {e}.")
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        if not isinstance(custom_id, str):
            custom_id = None
        if problem is None:
            assert custom_id is not None
            seen.add(custom_id)
            rows.append((index, custom_id, json.dumps(obj["body"]), "pending", None))
            continue
        code, message = problem
        rows.append((index, custom_id, None, "failed", error_line(custom_id, code, message)))
        problems.append({"code": code, "message": message, "param": None, "line": line_number})
    return rows, problems
