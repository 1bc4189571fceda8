"""Helpers for Batch API tests: batch input lines, uploads, waiting, reading result files."""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from typing import Any, Literal

import openai

from server.openai.json_body import JSONBodyError, loads_json
from tests.server.live import MODEL

URL: Literal["/v1/completions"] = "/v1/completions"


def request_line(custom_id: str, prompt: str, max_tokens: int = 3, **extra: Any) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body})


def greedy_lines(prompts: list[str], max_tokens: int) -> list[str]:
    """Lines c0, c1, ... of exactly `max_tokens` greedy tokens each (EOS ignored)."""
    return [
        request_line(f"c{i}", p, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]


def wait_completed(client: openai.OpenAI, batch_id: str, num_lines: int) -> None:
    """Until at least `num_lines` lines of the batch are done (a fault is due mid-batch)."""
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch_id).request_counts.completed < num_lines:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.02)


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_batch(client: openai.OpenAI, batch_id: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def expected_custom_ids(lines: list[str]) -> Counter[str | None]:
    """The custom_id each non-blank input line must appear under in the output or error file
    (None for a line that is not acceptable JSON or has no custom_id), duplicates counted."""
    ids: Counter[str | None] = Counter()
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = loads_json(line.encode())
        except JSONBodyError:  # not JSON, too deep, a lone surrogate, a too-long integer
            obj = None
        custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        ids[custom_id if isinstance(custom_id, str) and custom_id else None] += 1
    return ids


def assert_accounted(client: openai.OpenAI, batch: Any, lines: list[str]) -> None:
    """The batch invariant: a final batch has every input line in its output file or its
    error file, exactly once, and its request counts say so."""
    assert batch.status in ("completed", "cancelled", "expired"), batch
    output = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert all(
        line["error"] is not None or line["response"]["status_code"] != 200 for line in errors
    )
    seen = Counter(line["custom_id"] for line in output + errors)
    assert seen == expected_custom_ids(lines), (seen, expected_custom_ids(lines))
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (
        sum(1 for line in lines if line.strip()),
        len(output),
        len(errors),
    )
