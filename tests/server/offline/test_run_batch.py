"""`nanoflex run-batch` on the demo model: OpenAI Batch lines in and out, errors with
OpenAI's codes, and resume after a kill with exactly one line per custom_id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.core.model_files import DEMO_MODEL
from server.cli import main as cli_main
from server.offline.result_log import read_back, sort_log

ROOT = Path(__file__).resolve().parents[3]
MODEL = DEMO_MODEL
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def line(custom_id: str, url: str = COMPLETIONS, **body: Any) -> str:
    body = {"model": MODEL, "temperature": 0, "max_tokens": 6, **body}
    if "prompt" not in body and "messages" not in body:
        if url == CHAT:
            body["messages"] = [{"role": "user", "content": f"Tell me about {custom_id}"}]
        else:
            body["prompt"] = f"Once upon a time, {custom_id} said"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_input(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(inp: Path, out: Path) -> None:
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", MODEL, "--device", "cpu"]
    assert cli_main(argv) == 0


def by_custom_id(path: Path) -> dict[str, str]:
    """custom_id -> the raw line; fails on a duplicate."""
    lines = path.read_text().splitlines()
    ids = [json.loads(raw)["custom_id"] for raw in lines]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return dict(zip(ids, lines, strict=True))


def without_cache_hits(raw: str) -> str:
    """A line without `usage.prompt_tokens_details`: how many prompt tokens came from the
    prefix cache says where and after what a request ran, not what it answered."""
    record = json.loads(raw)
    body = (record.get("response") or {}).get("body") or {}
    body.get("usage", {}).pop("prompt_tokens_details", None)
    return json.dumps(record)


def ragged_lines(num: int) -> list[str]:
    return [
        line(f"r{i}", prompt="word " * (1 + 7 * i % 23), max_tokens=4 + (11 * i) % 29)
        for i in range(num)
    ]


def test_invalid_lines_are_reported_with_codes_while_the_rest_complete(tmp_path: Path) -> None:
    inp = write_input(
        tmp_path / "in.jsonl",
        [
            line("a"),
            "{not json",
            line("b", max_tokens=3, n=2),
            json.dumps({"method": "POST", "url": COMPLETIONS, "body": {}}),
            line("a"),  # duplicate
            line("w", url="/v1/embeddings"),
            json.dumps({"custom_id": "m", "method": "GET", "url": COMPLETIONS, "body": {}}),
            line("t", temperature=7.5),  # an invalid body parameter
            line("x", model="gpt-4o"),  # a model this run does not serve
            "",
            line("c", echo=True, logprobs=2),
        ],
    )
    out = tmp_path / "out.jsonl"
    run_cli(inp, out)
    results = {cid: json.loads(raw) for cid, raw in by_custom_id(out).items()}
    assert sorted(results) == ["a", "b", "c"]
    for record in results.values():
        assert record["error"] is None and record["id"].startswith("batch_req_")
        response = record["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "text_completion" and body["id"] == response["request_id"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
    assert len(results["b"]["response"]["body"]["choices"]) == 2
    c = results["c"]["response"]["body"]["choices"][0]
    assert c["text"].startswith("Once upon a time, c said") and c["logprobs"]["tokens"]

    errors = [json.loads(raw) for raw in Path(f"{out}.errors").read_text().splitlines()]
    codes = [
        (e["custom_id"], (e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"])
        for e in errors
    ]
    assert codes == [
        (None, "invalid_json_line"),
        (None, "missing_custom_id"),
        ("a", "duplicate_custom_id"),
        ("w", "invalid_url"),
        ("m", "invalid_method"),
        ("t", "invalid_value"),
        ("x", "model_not_found"),
    ]
    statuses = {e["custom_id"]: e["response"]["status_code"] for e in errors if e["response"]}
    assert statuses == {"t": 400, "x": 404}


def test_chat_batch_and_rerun_of_a_finished_batch_is_a_no_op(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", [line(f"q{i}", url=CHAT) for i in range(3)])
    out = tmp_path / "out.jsonl"
    run_cli(inp, out)
    first = out.read_bytes()
    for raw in first.decode().splitlines():
        body = json.loads(raw)["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        message = body["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        assert body["usage"]["prompt_tokens"] > 0
    run_cli(inp, out)
    assert out.read_bytes() == first
    out.write_bytes(b"".join(reversed(first.splitlines(keepends=True))))  # a driver lost while
    run_cli(inp, out)  # it sorted (or a file from before sorting): nothing to run, only sorting
    assert out.read_bytes() == first
    assert not Path(f"{out}.errors").exists()


def test_resume_after_a_torn_write_completes_each_custom_id_once(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", ragged_lines(12))
    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    run_cli(inp, full)
    kept = full.read_bytes().splitlines(keepends=True)[:5]
    torn = full.read_bytes().splitlines(keepends=True)[5][:40]  # a write cut mid-line
    partial.write_bytes(b"".join(kept) + torn)
    run_cli(inp, partial)
    assert partial.read_bytes().startswith(b"".join(kept))
    in_input_order = [f"r{i}" for i in range(12)]  # they ran in prefix order, not this one
    assert list(by_custom_id(full)) == list(by_custom_id(partial)) == in_input_order
    assert [without_cache_hits(raw) for raw in partial.read_text().splitlines()] == [
        without_cache_hits(raw) for raw in full.read_text().splitlines()
    ]


def test_read_back_truncates_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": ')
    assert read_back(path) == [{"id": 1}, {"id": 2}]
    assert path.read_bytes() == b'{"id": 1}\n{"id": 2}\n'


def test_sort_log_puts_lines_in_input_order_once_each_and_leaves_a_sorted_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    raw = [b'{"id": "c", "x": 1}\n', b'{"id":"a"}\n', b'{"id": "c", "x": 2}\n', b'{"id": "b"}\n']
    path.write_bytes(b"".join(raw) + b'{"id": "d", ')  # a torn tail too
    rank = {"a": 0, "b": 1, "c": 2}
    sort_log(path, lambda record: rank[record["id"]])
    assert path.read_bytes() == raw[1] + raw[3] + raw[0]  # bytes kept, the first "c" only
    inode = path.stat().st_ino
    sort_log(path, lambda record: rank[record["id"]])
    assert path.stat().st_ino == inode, "a sorted file was rewritten"
    assert not list(tmp_path.glob("*.sorting"))


@pytest.mark.slow  # 17-25 s idle, more on a loaded machine: three model loads
def test_sigkill_mid_run_then_rerun_gives_the_uninterrupted_output(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", [*ragged_lines(40), "{bad", line("r3")])
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    command = [sys.executable, "-m", "server.cli", "run-batch", "-i", str(inp), "--model", MODEL]
    command += ["--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([*command, "-o", str(full)], cwd=ROOT, env=env, check=True)

    proc = subprocess.Popen([*command, "-o", str(resumed)], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if resumed.exists() and resumed.read_bytes().count(b"\n") >= 8:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    num_before = resumed.read_bytes().count(b"\n")
    assert 8 <= num_before < 40

    subprocess.run([*command, "-o", str(resumed)], cwd=ROOT, env=env, check=True)
    assert by_custom_id(resumed) == by_custom_id(full)  # byte-identical line per custom_id
    assert len(by_custom_id(resumed)) == 40
    assert Path(f"{resumed}.errors").read_bytes() == Path(f"{full}.errors").read_bytes()
