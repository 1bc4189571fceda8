"""Pooling requests on the generation engine (torch-free): a decoder embedder's or reranker's
inputs (engine/core/pooling.py) each queued as one prefill-only request
(`SamplingParams.pooling`), all at once, so that the scheduler batches them with each
other and with whatever else runs (chunked prefill, online before batch work, the policy's
placement and offloading), and each answered by its pooled output.
"""

from __future__ import annotations

import asyncio
import uuid

from engine.core.pooling import PoolingSpec
from engine.core.rerank_prompt import rerank_token_ids
from engine.core.sampling_params import SamplingParams
from engine.runtime.engine_client import EngineClient

POOLING = SamplingParams(max_tokens=0, temperature=0.0, pooling=True)


class PooledRequestError(RuntimeError):
    """A pooling request failed inside the engine (the message says why)."""


async def run_pooled(
    engine: EngineClient, inputs: list[list[int]], priority: int
) -> list[list[float]]:
    """Each input's pooled output (a vector, or [score]), in input order."""
    tag = uuid.uuid4().hex[:12]

    async def one(k: int, token_ids: list[int]) -> list[float]:
        request_id = f"pool-{tag}-{k}"
        async for delta in engine.generate(request_id, token_ids, POOLING, priority, stream=False):
            if delta.finish_reason == "error":
                raise PooledRequestError(delta.error or "the pooling request failed")
            if delta.pooled is not None:
                return delta.pooled
        raise PooledRequestError(f"{request_id} ended without its pooled output")

    tasks = [asyncio.ensure_future(one(k, ids)) for k, ids in enumerate(inputs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # one failed (or the caller left): abort the rest
        for task in tasks:
            task.cancel()
        raise


def pair_input(
    spec: PoolingSpec, engine: EngineClient, first: str, second: str
) -> tuple[list[int], list[int]]:
    """A decoder reranker's input for (query, document): its prompt's token ids (no token
    types: zeros)."""
    assert spec.task == "score" and not spec.is_encoder
    ids = rerank_token_ids(lambda text: engine.encode(text, False), first, second)
    return ids, [0] * len(ids)
