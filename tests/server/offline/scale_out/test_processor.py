"""The Ray Data processor: a dataset of OpenAI batch rows and plain prompt rows through two
actors of the demo model, compared with the local run-batch on the same requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server.cli import main as cli_main
from server.offline.scale_out.processor import process
from tests.server.offline.test_run_batch import MODEL, line, write_input

PROMPTS = [f"The {i}th story begins" for i in range(10)]
SAMPLING = {"max_tokens": 12, "temperature": 0}


def test_batch_rows_and_prompt_rows_give_the_local_run_batchs_answers(
    ray_cluster: Any, tmp_path: Path
) -> None:
    lines = [line(f"b{i}", prompt=p, **SAMPLING) for i, p in enumerate(PROMPTS)]
    inp, out = write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", MODEL, "--device", "cpu"]
    assert cli_main(argv) == 0
    local = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}

    rows: list[dict[str, Any]] = [json.loads(raw) for raw in lines]  # bodies as dicts
    rows += [{"custom_id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.append({"custom_id": "bad", "body": {"model": MODEL, "prompt": "x", "temperature": 9}})
    ds = ray_cluster.data.from_items(rows)
    results = process(
        ds, replicas=2, batch_rows=4, sampling=SAMPLING, model=MODEL, device="cpu"
    ).take_all()
    by_id = {r["custom_id"]: r for r in results}
    assert sorted(by_id) == sorted(r["custom_id"] for r in rows)

    for i in range(len(PROMPTS)):
        batch_row, prompt_row = by_id[f"b{i}"], by_id[f"p{i}"]
        expected = local[f"b{i}"]["body"]
        body = json.loads(batch_row["response"])
        assert body["id"] == local[f"b{i}"]["request_id"]  # the id run-batch gives custom_id
        assert body["choices"] == expected["choices"]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cache hits may differ
            assert body["usage"][key] == expected["usage"][key]
        for row in (batch_row, prompt_row):
            assert row["status_code"] == 200 and row["error"] is None
            assert row["text"] == expected["choices"][0]["text"]
            assert row["finish_reason"] == expected["choices"][0]["finish_reason"]
            assert row["prompt_tokens"] == expected["usage"]["prompt_tokens"]
            assert row["completion_tokens"] == expected["usage"]["completion_tokens"]
            assert len(row["token_ids"]) == row["completion_tokens"] > 0
        assert list(prompt_row["token_ids"]) == list(batch_row["token_ids"])
    bad = by_id["bad"]
    assert bad["status_code"] == 400 and "temperature" in bad["error"] and bad["text"] == ""
    assert json.loads(bad["response"])["error"]["param"] == "temperature"
