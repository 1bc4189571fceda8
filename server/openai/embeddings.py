"""Pooling routes, as OpenAI and vLLM serve them, for a pooling model (engine/core/pooling.py):

- `POST /v1/embeddings` (OpenAI's): `input` a string, a list of strings, a list of token
  ids or a list of such lists; `encoding_format` float or base64 (little-endian float32, as
  OpenAI sends it); `dimensions` for a Matryoshka model (the vector cut to its first
  `dimensions` values, normalized again when the model normalizes).
- `POST /v1/score` (vLLM's): `text_1` and `text_2`, each a string or a list (one against
  many, or pairwise), scored by a cross-encoder.
- `POST /v1/rerank` (vLLM's, Jina's and Cohere's shape): `query`, `documents`, `top_n`; the
  documents by relevance, highest first.

A request is prepared (validated, tokenized) into a `PoolingJob`, carried by the serving
layer's `Prepared` so that online calls and Batch API lines run it alike.
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.runtime.engine_client import EngineClient
from server.openai.errors import invalid_request
from server.openai.requests import parse_body

EMBEDDINGS = "/v1/embeddings"
SCORE = "/v1/score"
RERANK = "/v1/rerank"
POOLING_ENDPOINTS = (EMBEDDINGS, SCORE, RERANK)
TASK_OF = {EMBEDDINGS: "embed", SCORE: "score", RERANK: "score"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: PoolingUsage


class Score(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreList(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Score]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    document: dict[str, str] | None
    relevance_score: float


class RerankList(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


@dataclass(frozen=True, slots=True)
class PoolingJob:
    """A validated pooling request: what to run and how to answer."""

    endpoint: str
    inputs: list[list[int]]
    """Token ids per input (per pair for score and rerank)."""
    type_ids: list[list[int]]
    """Token type ids per pair (empty for embeddings)."""
    encoding_format: str = "float"
    dimensions: int | None = None
    documents: list[str] | None = None
    """Rerank: the documents, answered back."""
    top_n: int | None = None


def pooling_job(engine: EngineClient, endpoint: str, body: Any) -> PoolingJob:
    """The request checked against the model (its task, its length, its dimensions) and
    tokenized; raises the 400 a client gets."""
    spec = engine.pooling_spec
    assert spec is not None, "a pooling job on a generation model"
    if TASK_OF[endpoint] != spec.task:
        serves = EMBEDDINGS if spec.task == "embed" else f"{SCORE} and {RERANK}"
        kind = "an embedding model" if spec.task == "embed" else "a cross-encoder"
        raise invalid_request(
            f"{engine.model_name} is {kind}: it serves {serves}, not {endpoint}",
            code="unsupported_task",
        )
    if endpoint == EMBEDDINGS:
        req = parse_body(EmbeddingRequest, body)
        if req.dimensions is not None and (why := spec.check_dimensions(req.dimensions)):
            raise invalid_request(why, param="dimensions")
        inputs = _token_inputs(engine, req.input)
        _check_lengths(engine, inputs)
        return PoolingJob(endpoint, inputs, [], req.encoding_format, req.dimensions)
    if endpoint == SCORE:
        score = parse_body(ScoreRequest, body)
        pairs = _pairs(score.text_1, score.text_2)
    else:
        rerank = parse_body(RerankRequest, body)
        if not rerank.documents:
            raise invalid_request("documents must not be empty", param="documents")
        if rerank.top_n is not None and rerank.top_n < 0:
            raise invalid_request("top_n must be 0 (all) or more", param="top_n")
        pairs = [(rerank.query, document) for document in rerank.documents]
    encoded = [engine.encode_pair(first, second) for first, second in pairs]
    inputs = [ids for ids, _ in encoded]
    _check_lengths(engine, inputs)
    if endpoint == SCORE:
        return PoolingJob(endpoint, inputs, [types for _, types in encoded])
    documents = rerank.documents if rerank.return_documents else None
    return PoolingJob(
        endpoint, inputs, [t for _, t in encoded], documents=documents, top_n=rerank.top_n
    )


def _token_inputs(
    engine: EngineClient, value: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    assert engine.pooling_spec is not None
    vocab_size = engine.pooling_spec.vocab_size  # the model's embedding rows
    items: list[Any] = [value] if isinstance(value, str) else list(value)
    if not items:
        raise invalid_request("input must not be empty", param="input")
    if all(isinstance(v, int) for v in items):
        items = [items]  # one input of token ids
    inputs: list[list[int]] = []
    for k, item in enumerate(items):
        ids = engine.encode(item) if isinstance(item, str) else [int(t) for t in item]
        if not ids:
            raise invalid_request(f"input {k} is empty", param="input")
        if any(not 0 <= t < vocab_size for t in ids):
            raise invalid_request(f"input {k} has token ids outside the vocabulary", param="input")
        inputs.append(ids)
    return inputs


def _pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one against many, or lists of one length pairwise."""
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not firsts or not seconds:
        raise invalid_request("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise invalid_request(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
            "or as many as text_2", param="text_1"
        )  # fmt: skip
    return list(zip(firsts, seconds, strict=True))


def _check_lengths(engine: EngineClient, inputs: list[list[int]]) -> None:
    limit = engine.max_model_len
    for k, ids in enumerate(inputs):
        if len(ids) > limit:
            raise invalid_request(
                f"input {k} has {len(ids)} tokens, more than this model's {limit}",
                code="context_length_exceeded",
            )


async def run_job(
    engine: EngineClient, job: PoolingJob, request_id: str, created: int, priority: int
) -> BaseModel:
    """The answer's body; its inputs run at `priority` (online before batch work)."""
    num_tokens = sum(len(ids) for ids in job.inputs)
    usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    model = engine.model_name
    if job.endpoint == EMBEDDINGS:
        vectors = await engine.embed(job.inputs, priority)
        data = [
            Embedding(
                object="embedding",
                index=k,
                embedding=_encoded(_shortened(v, job, engine), job.encoding_format),
            )
            for k, v in enumerate(vectors)
        ]
        return EmbeddingList(object="list", data=data, model=model, usage=usage)
    scores = await engine.score(list(zip(job.inputs, job.type_ids, strict=True)), priority)
    if job.endpoint == SCORE:
        data_scores = [Score(index=k, object="score", score=s) for k, s in enumerate(scores)]
        return ScoreList(
            id=request_id, object="list", created=created, model=model, data=data_scores,
            usage=usage,
        )  # fmt: skip
    order = sorted(range(len(scores)), key=lambda k: -scores[k])
    if job.top_n:
        order = order[: job.top_n]
    results = [
        RerankResult(
            index=k,
            document={"text": job.documents[k]} if job.documents is not None else None,
            relevance_score=scores[k],
        )
        for k in order
    ]
    return RerankList(id=request_id, model=model, results=results, usage=usage)


def _shortened(vector: list[float], job: PoolingJob, engine: EngineClient) -> list[float]:
    """A Matryoshka vector cut to `dimensions`, normalized again when the model normalizes."""
    if job.dimensions is None or job.dimensions >= len(vector):
        return vector
    head = vector[: job.dimensions]
    spec = engine.pooling_spec
    if spec is None or not spec.normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
