"""Schema fuzzing: schemathesis generates requests from the daemon's own /openapi.json (bodies
included) and sends them to a real uvicorn server on the real engine (demo model).

Every answer must be no 5xx, a status the schema lists, the content type it lists and a body
that validates against its response model; requests that violate the schema (negative mode)
must be refused. Half of the valid completion and chat bodies are pointed at the served
model (with max_tokens capped at 4 so each runs quickly), so generation is fuzzed too, not
only validation. Each operation of the schema is fuzzed in turn, with its own budget, and
every one must be reached. A bounded run is in CI; `-m slow` runs a longer one. The counts
printed are the ones recorded in docs/benchmarks.md ("Schema fuzzing").
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.live import MODEL, LiveServer, ServerFactory

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@dataclass
class FuzzReport:
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def num_operations(self) -> int:
        return len({(method, path) for method, path, _ in self.statuses})

    def summary(self, mode: GenerationMode) -> str:
        by_status = Counter(status for _, _, status in self.statuses.elements())
        return (
            f"fuzz ({mode.value}): {self.num_requests} requests over {self.num_operations} "
            f"operations, statuses {dict(sorted(by_status.items()))}, 0 failures"
        )


def _aim(case: Any) -> None:
    """Point a generated completion or chat body at the served model, briefly."""
    body = case.body
    if not isinstance(body, dict) or "model" not in body:
        return
    body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = max(1, min(body[key], 4))
        elif key in body:  # null: the rest of the context window, thousands of steps
            body[key] = 4
    if case.path == "/v1/chat/completions" and "max_tokens" not in body:
        body["max_tokens"] = 4  # chat defaults to the rest of the context window
    if case.path == "/v1/responses" and "max_output_tokens" not in body:
        body["max_output_tokens"] = 4  # so do responses


def fuzz(live: LiveServer, mode: GenerationMode, per_operation: int) -> FuzzReport:
    """Send `per_operation` generated requests to each operation of the schema in turn (any
    failed check fails the test, shrunk); the report counts the operations reached."""
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    report = FuzzReport()
    for operation in _operations(schema, mode):

        @settings(
            max_examples=per_operation,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate, Phase.shrink],
        )
        @given(case=operation.as_strategy(generation_mode=mode), aim=st.booleans())
        def run(case: Any, aim: bool) -> None:
            if aim and mode == GenerationMode.POSITIVE:  # negative bodies must stay invalid
                _aim(case)
            response = case.call(base_url=live.base_url, timeout=120)
            report.statuses[(case.method, case.path, response.status_code)] += 1
            case.validate_response(response, checks=checks)

        run()
    return report


def _can_violate(schema: Any, operation: Any) -> bool:
    """Whether a request to the operation can break its schema: it takes a body or a
    parameter narrower than any string (a path's bare string id accepts every value)."""
    spec = schema.raw_schema["paths"][operation.path][operation.method.lower()]
    return "requestBody" in spec or any(
        {k: v for k, v in parameter["schema"].items() if k != "title"} != {"type": "string"}
        for parameter in spec.get("parameters", [])
    )


def _operations(schema: Any, mode: GenerationMode) -> list[Any]:
    """The operations a run in `mode` sends to: all, or in negative mode those a request can
    get wrong."""
    operations = [result.ok() for result in schema.get_all_operations()]
    if mode == GenerationMode.NEGATIVE:
        return [operation for operation in operations if _can_violate(schema, operation)]
    return operations


NUM_OPERATIONS = {GenerationMode.POSITIVE: 26, GenerationMode.NEGATIVE: 15}
"""Operations reached, each of them: all, and in negative mode those whose inputs can
violate the schema (the JSON bodies, the upload form, the list and model queries)."""


@pytest.mark.parametrize(("mode", "per_operation"), [(GenerationMode.POSITIVE, 10),
                                                      (GenerationMode.NEGATIVE, 8)])  # fmt: skip
def test_fuzz_bounded(make_server: ServerFactory, mode: GenerationMode, per_operation: int) -> None:
    report = fuzz(make_server(), mode, per_operation)
    assert report.num_operations == NUM_OPERATIONS[mode]
    print("\n" + report.summary(mode))
    record(f"bounded, {mode.value}", report)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "per_operation"), [(GenerationMode.POSITIVE, 200), (GenerationMode.NEGATIVE, 120)]
)
def test_fuzz_long(make_server: ServerFactory, mode: GenerationMode, per_operation: int) -> None:
    report = fuzz(make_server(), mode, per_operation)
    print("\n" + report.summary(mode))
    record(f"long, {mode.value}", report)


RESULTS_ENV = "NANOFLEX_FUZZ_RESULTS"
"""When set, each run adds its row to this results file (docs/benchmarks.md's table)."""
HEADER = ["run", "requests", "operations", "answers", "failures"]


def record(run: str, report: FuzzReport) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    data = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
    rows = {row[0]: row for row in data.get("table", {}).get("rows", [])}
    by_status = Counter(status for _, _, status in report.statuses.elements())
    answers = ", ".join(f"{status}: {n:,}" for status, n in sorted(by_status.items()))
    rows[run] = [run, f"{report.num_requests:,}", str(report.num_operations), answers, "0"]
    order = [f"{k}, {m}" for k in ("bounded", "long") for m in ("positive", "negative")]
    table = {"header": HEADER, "rows": [rows[r] for r in order if r in rows]}
    counts = {
        f"{method} {path} {status}": n for (method, path, status), n in report.statuses.items()
    }
    results = {**data.get("results", {}), run: counts}
    Path(path).write_text(json.dumps({"table": table, "results": results}, indent=2) + "\n")
