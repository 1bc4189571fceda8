"""The HTTP examples of README.md and docs/*.md, run as written against a real daemon serving
the default model (SmolLM2-135M-Instruct) on loopback: every curl command with the real
`curl`, every Python block of docs/api.md in order in one namespace with the real `openai`
client. The other examples run in tests/docs/test_doc_commands.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from engine.runtime.step_loop_client import build_engine_client
from server.http.settings import ServerSettings
from tests.docs.doc_examples import classify, examples, rule
from tests.server.batch_files import read_lines, wait_batch
from tests.server.live import LiveServer, engine_args, start_server

ROOT = Path(__file__).resolve().parents[2]
DOC_URL = re.compile(r"http://(localhost|127\.0\.0\.1):8000|(?<![\w/])localhost:8000")
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
ANSWER = "The capital of France is Paris."
NUM_BATCH_LINES = 24  # the batch examples' requests.jsonl: the doc's line, this many times


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in document order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def commands(bash: str) -> list[str]:
    """The commands of a bash block, one per logical line (continuations joined)."""
    return [c.strip() for c in bash.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`nanoflex serve` with no --model (the default model) and no API key, so both the
    README's keyless examples and api.md's `Bearer sk-local` ones are accepted."""
    engine = build_engine_client(engine_args(model=None))
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("data"))
    server = start_server(settings, engine)
    yield server
    server.stop()


class Session:
    """Runs doc blocks against `live` in `cwd`: curl commands and one Python namespace."""

    def __init__(self, live: LiveServer, cwd: Path) -> None:
        self.live, self.cwd = live, cwd
        self.namespace: dict[str, object] = {}

    def localize(self, code: str) -> str:
        return DOC_URL.sub(self.live.base_url, code)

    def python(self, code: str) -> str:
        out = io.StringIO()
        with contextlib.chdir(self.cwd), contextlib.redirect_stdout(out):
            exec(compile(self.localize(code), "<doc>", "exec"), self.namespace)
        return out.getvalue()

    def curl(self, command: str, ids: dict[str, str]) -> str:
        for placeholder, real in ids.items():
            command = command.replace(placeholder, real)
        assert command.startswith("curl "), command
        run = subprocess.run(
            ["bash", "-c", self.localize(command)],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, (command, run.stderr)
        body = run.stdout
        if body.startswith("{"):
            assert "error" not in json.loads(body), (command, body)
        for line in body.splitlines():  # server-sent events
            assert not line.startswith('data: {"error"'), (command, line)
        return body

    def upload(self) -> str:
        with self.live.http() as http:
            files = {"file": ("requests.jsonl", (self.cwd / "requests.jsonl").read_bytes())}
            r = http.post("/v1/files", data={"purpose": "batch"}, files=files)
        r.raise_for_status()
        return str(r.json()["id"])

    def start_batch(self) -> str:
        with self.live.http() as http:
            r = http.post(
                "/v1/batches",
                json={
                    "input_file_id": self.upload(),
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
        r.raise_for_status()
        return str(r.json()["id"])


def test_readme_first_examples_answer(live: LiveServer, tmp_path: Path) -> None:
    session = Session(live, tmp_path)
    examples = [(lang, code) for lang, code in blocks(ROOT / "README.md") if ":8000/" in code]
    (_, curl), (_, python) = examples[:2]
    reply = json.loads(session.curl(curl.strip(), {}))  # one command over several lines
    assert reply["choices"][0]["message"]["content"] == ANSWER
    assert session.python(python).strip() == ANSWER


def test_api_doc_examples_run(live: LiveServer, tmp_path: Path) -> None:
    session = Session(live, tmp_path)
    found = blocks(ROOT / "docs" / "api.md")
    line, *structured = [code for lang, code in found if lang == "jsonl"]
    request = json.loads(line)
    lines = [json.dumps({**request, "custom_id": f"q{i}"}) for i in range(NUM_BATCH_LINES)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    printed = []
    num_curl = 0
    for lang, code in found:
        if lang == "python":
            printed.append(session.python(code))
        elif lang == "bash":
            ids = {}
            if "file-abc" in code:  # a file of its own: the block may delete it
                ids["file-abc"] = session.upload()
            if "batch_abc" in code:  # a batch still running when the block cancels it
                ids["batch_abc"] = session.start_batch()
            for command in commands(code):
                session.curl(command, ids)
                num_curl += 1
    assert num_curl >= 15 and len(printed) >= 8  # every block was found
    text = "".join(printed)
    assert ANSWER in text
    batch = session.namespace["b"]
    assert getattr(batch, "status", None) == "completed"
    results = str(session.namespace["results"]).splitlines()
    assert len(results) == NUM_BATCH_LINES
    assert all(json.loads(r)["response"]["status_code"] == 200 for r in results)
    other = getattr(session.namespace["other"], "id", "")
    with httpx.Client(base_url=live.base_url) as http:
        got = http.get(f"/v1/batches/{other}").json()
        assert got["status"] in ("cancelling", "cancelled"), got
    assert structured, "api.md shows a Batch API file of structured-output lines"
    for block in structured:
        run_structured_batch(live, tmp_path, block)


def run_structured_batch(live: LiveServer, tmp_path: Path, block: str) -> None:
    """A doc's Batch API file whose lines ask for JSON: every line answers 200 and its
    content validates against the line's schema."""
    lines = [json.loads(raw) for raw in block.splitlines() if raw.strip()]
    (tmp_path / "structured.jsonl").write_text(block)
    client = live.openai()
    with (tmp_path / "structured.jsonl").open("rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint=lines[0]["url"], completion_window="24h"
    )
    batch = wait_batch(client, batch.id, timeout_s=300)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    outputs = {o["custom_id"]: o for o in read_lines(client, batch.output_file_id)}
    for line in lines:
        body = outputs[line["custom_id"]]["response"]["body"]
        schema = line["body"]["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


def test_other_docs_http_examples_run(live: LiveServer, tmp_path: Path) -> None:
    """The HTTP examples outside README.md and docs/api.md (docs/deployment.md's checks)."""
    session = Session(live, tmp_path)
    daemon = rule("daemon")
    found = [
        e for e in examples() if classify(e) is daemon and e.doc not in ("README.md", "docs/api.md")
    ]
    assert found
    for example in found:
        body = session.curl(example.code, {})
        assert body.strip(), example.code
