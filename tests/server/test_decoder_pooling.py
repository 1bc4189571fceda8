"""Decoder pooling models on the generation engine, over a real daemon: a Qwen3 embedder with
its weights on the CPU and disk tiers (not the compute device's) and its prompts cut into
prefill chunks gives transformers' vectors through /v1/embeddings and a Batch API job; a
Qwen3-Reranker (a Qwen3ForCausalLM, tied and untied) scores as its model card computes,
P(yes) of a softmax over the last token's "no" and "yes" logits, through /v1/score,
/v1/rerank, a Batch API job and `nanoflex run-batch` lines; a converted one-label
Qwen3ForSequenceClassification scores with its own head."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core.engine_args import EngineArgs
from engine.core.rerank_prompt import PREFIX, SUFFIX
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from server.cli import main as cli_main
from server.http.settings import ServerSettings
from tests.engine.tiny_pooling import (
    RERANKER_SPECIALS,
    RERANKER_WORDS,
    build_pooling,
    build_qwen3_reranker,
    tiny_tokenizer,
)
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import LiveServer, start_server

OFFLOADED = Policy(weights_frac=(0.0, 0.5, 0.5))
"""Every layer homed off the compute device: half on the CPU tier, half on disk."""
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def serve(model_dir: Path, data: Path, policy: Policy, **engine: Any) -> LiveServer:
    args = EngineArgs(model=str(model_dir), policy=policy, device="cpu", **engine)
    client = StepLoopClient(args, model_dir, policy, model_name="pooled", in_process=True)
    return start_server(ServerSettings(data_dir=data), client)


def batch_bodies(server: LiveServer, endpoint: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """Each body as a line of one Batch API job on `endpoint`: the answers' bodies in order."""
    api = server.openai()
    lines = [
        json.dumps({"custom_id": f"l{k}", "method": "POST", "url": endpoint, "body": body})
        for k, body in enumerate(bodies)
    ]
    target: Any = endpoint
    batch = api.batches.create(
        input_file_id=upload(api, lines), endpoint=target, completion_window="24h"
    )
    done = wait_batch(api, batch.id, timeout_s=120)
    assert done.status == "completed" and done.request_counts.completed == len(bodies)
    out = {line["custom_id"]: line["response"] for line in read_lines(api, done.output_file_id)}
    assert all(out[f"l{k}"]["status_code"] == 200 for k in range(len(bodies)))
    return [out[f"l{k}"]["body"] for k in range(len(bodies))]


def test_offloaded_qwen3_embedder_gives_transformers_vectors(tmp_path: Path) -> None:
    from transformers import AutoModel

    model_dir = build_pooling("qwen3-embedding", tmp_path / "q")
    rows = [[5, 17, 33, 8, 2], [9, 4], [(11 * k) % 50 + 3 for k in range(40)]]
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        last = [model(input_ids=torch.tensor([r])).last_hidden_state[0, -1] for r in rows]
    theirs = F.normalize(torch.stack(last), dim=-1)
    server = serve(model_dir, tmp_path / "data", OFFLOADED, max_step_tokens=16)  # 40 = 3 chunks
    try:
        placement = server.engine._executor.describe().placement  # type: ignore[attr-defined]
        assert placement.realized_weights_frac[0] == 0.0 and placement.weights_bytes["disk"] > 0
        api = server.openai()
        got = api.embeddings.create(model="pooled", input=rows)  # base64, decoded by the client
        ours = torch.tensor([d.embedding for d in got.data])
        assert F.cosine_similarity(ours, theirs, dim=-1).min() >= 0.999
        assert got.usage.prompt_tokens == sum(len(r) for r in rows)
        floats = api.embeddings.create(model="pooled", input=rows[2], encoding_format="float")
        assert F.cosine_similarity(torch.tensor(floats.data[0].embedding), theirs[2], dim=0) > 0.999
        answers = batch_bodies(server, "/v1/embeddings", [{"input": row} for row in rows])
        vectors = torch.tensor([a["data"][0]["embedding"] for a in answers])
        assert F.cosine_similarity(vectors, theirs, dim=-1).min() >= 0.999
    finally:
        server.stop()


def card_scores(model_dir: Path, query: str, documents: list[str]) -> list[float]:
    """Qwen3-Reranker's model card, in transformers: the prompt's prefix, pair and suffix
    tokenized apart, then P(yes) of a softmax over the last token's [no, yes] logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    scores = []
    for document in documents:
        pair = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        parts = [tokenizer.encode(t, add_special_tokens=False) for t in (PREFIX, pair, SUFFIX)]
        ids = [token for part in parts for token in part]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(logits[[no, yes]], dim=-1)[1].exp().item())
    return scores


QUERY = "what do people eat"
DOCUMENTS = ["A man is eating food.", "A movie.", "Bread is baked."]


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_reranker_scores_as_its_model_card(tmp_path: Path, tied: bool) -> None:
    model_dir = build_qwen3_reranker(tmp_path / "Qwen3-Reranker-tiny", tied=tied)
    expected = card_scores(model_dir, QUERY, DOCUMENTS)
    server = serve(model_dir, tmp_path / "data", Policy() if tied else OFFLOADED)
    try:
        http = server.http()
        scored = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
        ranked = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
        order = sorted(range(3), key=lambda k: -expected[k])
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            [expected[k] for k in order], abs=1e-5
        )
        # vLLM's client-side formatting: text_1 carries the prefix, text_2 the suffix
        text_1 = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n"
        text_2 = [f"<Document>: {d}{SUFFIX}" for d in DOCUMENTS]
        preformatted = http.post("/v1/score", json={"text_1": text_1, "text_2": text_2}).json()
        assert [d["score"] for d in preformatted["data"]] == pytest.approx(expected, abs=1e-5)
        if tied:
            return
        bodies = [{"query": QUERY, "documents": [d]} for d in DOCUMENTS]
        answers = batch_bodies(server, "/v1/rerank", bodies)
        scores = [a["results"][0]["relevance_score"] for a in answers]
        assert scores == pytest.approx(expected, abs=1e-5)
    finally:
        server.stop()


def test_qwen3_reranker_in_run_batch_lines(tmp_path: Path) -> None:
    """A reranker declared in its config (vLLM's override), not by its directory's name."""
    model_dir = build_qwen3_reranker(tmp_path / "tiny", tied=False)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "is_original_qwen3_reranker": 1}))
    expected = card_scores(model_dir, QUERY, DOCUMENTS)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": "s", "method": "POST", "url": "/v1/score",
         "body": {"text_1": QUERY, "text_2": DOCUMENTS}},
    ]  # fmt: skip
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    policy = tmp_path / "policy.json"
    policy.write_text(OFFLOADED.to_json())
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(model_dir)]
    assert cli_main([*argv, "--device", "cpu", "--policy", str(policy)]) == 0
    answer = json.loads(out.read_text().splitlines()[0])["response"]["body"]
    assert [d["score"] for d in answer["data"]] == pytest.approx(expected, abs=1e-5)


def test_converted_reranker_scores_with_its_own_head(tmp_path: Path) -> None:
    """A Qwen3ForSequenceClassification of one label (a converted Qwen3-Reranker): its score
    head's logit through a sigmoid, as transformers computes it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
        pad_token_id=0,
    )  # fmt: skip
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    model_dir = tmp_path / "seq-cls"
    model.save_pretrained(model_dir)
    tiny_tokenizer(RERANKER_WORDS, RERANKER_SPECIALS, pairs=False).save_pretrained(model_dir)
    rows = [[5, 17, 33, 8, 2], [9, 4, 60, 61]]
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([r])).logits[0, 0].sigmoid().item() for r in rows]
    args = EngineArgs(model=str(model_dir), policy=OFFLOADED, device="cpu")
    engine = StepLoopClient(args, model_dir, OFFLOADED, model_name="cls", in_process=True)

    async def scores() -> list[float]:
        await engine.start()
        try:
            return await engine.score([(r, [0] * len(r)) for r in rows])
        finally:
            await engine.shutdown()

    assert asyncio.run(scores()) == pytest.approx(expected, abs=1e-5)
