"""bench/results/plans-hybrid-h100.json: its table is what `bench.plans.hybrid` renders from its
own results, and those results are the policy package's numbers for the plans they record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.plans.hybrid import MODELS, row
from policy.catalog import BUILTIN_MODELS
from policy.policy import Policy
from policy.state_cost import state_bytes_per_tier

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "plans-hybrid-h100.json"


def test_table_rows_render_the_recorded_plans() -> None:
    data = json.loads(RESULTS.read_text())
    assert [r["model"] for r in data["results"]] == list(MODELS)
    assert data["table"]["rows"] == [row(r) for r in data["results"]]
    for r in data["results"]:
        model, policy, states = BUILTIN_MODELS[r["model"]], Policy.from_dict(r["plan"]), r["states"]
        assert states["state_bytes_per_sequence"] == model.state_bytes_per_sequence
        assert states["kv_bytes_per_token"] == model.kv_bytes_per_token
        assert states["state_bytes"] == pytest.approx(state_bytes_per_tier(model, policy))
        for tier in ("gpu", "cpu"):  # the states fit in what the plan's peak counts
            assert states["state_bytes"][tier] <= r["peak_bytes"][tier]
