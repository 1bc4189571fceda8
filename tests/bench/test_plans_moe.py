"""bench/results/plans-moe-h100.json: its table is what `bench.plans.moe` renders from its own
results, and those results are the policy package's numbers for the plans they record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.plans.moe import row
from policy.catalog import BUILTIN_MODELS
from policy.moe import expected_distinct_experts, experts_per_tier
from policy.policy import Policy

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "plans-moe-h100.json"


def test_table_rows_render_the_recorded_plans() -> None:
    data = json.loads(RESULTS.read_text())
    assert data["table"]["rows"] == [row(r) for r in data["results"]]
    for r in data["results"]:
        model, policy, moe = BUILTIN_MODELS[r["model"]], Policy.from_dict(r["plan"]), r["moe"]
        gpu, cpu, disk = experts_per_tier(model, policy)
        assert moe["experts_per_layer"] == {"gpu": gpu, "cpu": cpu, "disk": disk}
        top_k = moe["num_experts_per_tok"]
        distinct = expected_distinct_experts(model.num_experts, top_k, policy.block_size)
        assert moe["decode"]["distinct_experts"] == pytest.approx(distinct)
        assert moe["active_params"] == model.active_params
