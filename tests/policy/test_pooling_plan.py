"""Decoder pooling models in the planner, config-only: Qwen3-Embedding and Qwen3-Reranker are
known by their hub ids without a download, priced with the head the engine gives them (no LM
head; a one-row classifier) and as a prefill only, and Qwen3-Embedding-8B gets a plan under a
16 GiB GPU."""

from __future__ import annotations

import json

import pytest

from policy import WorkloadSpec
from policy.catalog import resolve_model_spec
from server.cli import main as cli_main


def test_pooling_models_priced_with_their_heads() -> None:
    embedder = resolve_model_spec("Qwen/Qwen3-Embedding-8B")
    reranker = resolve_model_spec("Qwen/Qwen3-Reranker-8B")
    generator = resolve_model_spec("Qwen/Qwen3-8B")
    assert (embedder.pooling, reranker.pooling, generator.pooling) == ("embed", "score", "")
    lm_head = embedder.vocab_size * embedder.hidden_size
    assert reranker.embedding_params - embedder.embedding_params == embedder.hidden_size
    assert embedder.head_width == embedder.hidden_size and reranker.head_width == 1
    assert generator.embedding_params > embedder.embedding_params + lm_head * 0.99
    workload = WorkloadSpec(512, 32)
    assert workload.priced_for(embedder) == WorkloadSpec(512, 1)
    assert workload.priced_for(generator) is workload


def test_nanoflex_plan_prices_the_embedder_as_a_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    """Under 16 GiB on the test profile's CPU in float32 (28 GiB of weights), offloaded. The dtype
    is named: on a CPU with native bfloat16 the default is bfloat16 (14 GiB, which fits)."""
    argv = ["plan", "--model", "Qwen/Qwen3-Embedding-8B", "--gpu-mem", "16GiB", "--json"]
    argv += ["--dtype", "float32"]
    assert cli_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workload"] == {"prompt_len": 512, "gen_len": 1}
    assert plan["policy"]["weights_frac"][0] < 1.0
