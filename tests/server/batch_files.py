"""Helpers for Batch API tests: batch input lines, uploads, waiting, reading result files."""

from __future__ import annotations

import io
import json
import time
from typing import Any, Literal

import openai

from tests.server.live import MODEL

URL: Literal["/v1/completions"] = "/v1/completions"


def request_line(custom_id: str, prompt: str, max_tokens: int = 3, **extra: Any) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": body})


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
