"""Every figure table in the docs has its results file, and says what the file says.

A table of measurements is preceded by `<!-- source: bench/results/X.json -->`; the file
holds {"table": {"header": [...], "rows": [[...]]}, ...} exactly as the command that wrote
it printed the table. A table of inputs (cases, constants) is preceded by
`<!-- inputs: FILE -->`. In docs/benchmarks.md every table must carry one or the other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
MARKER = re.compile(r"<!-- (source|inputs): (\S+) -->")


def tables(path: Path) -> list[tuple[str | None, str | None, list[list[str]], int]]:
    """(marker kind, marked file, rows incl. header, line number) of every Markdown table."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            start = i
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            before = [x for x in lines[:start] if x.strip()]
            match = MARKER.fullmatch(before[-1].strip()) if before else None
            kind, target = (match.group(1), match.group(2)) if match else (None, None)
            out.append((kind, target, rows, start + 1))
        else:
            i += 1
    return out


SOURCED = [
    (doc, target, rows, line)
    for doc in DOCS
    for kind, target, rows, line in tables(doc)
    if kind == "source"
]


@pytest.mark.parametrize(
    "doc,target,rows,line",
    SOURCED,
    ids=[f"{d.name}:{line}" for d, _, _, line in SOURCED],
)
def test_sourced_table_equals_its_results_file(
    doc: Path, target: str, rows: list[list[str]], line: int
) -> None:
    path = REPO / target
    assert path.is_file(), f"{doc.name}:{line} cites {target}, which does not exist"
    table = json.loads(path.read_text())["table"]
    assert rows[0] == table["header"], f"{doc.name}:{line}: header differs from {target}"
    assert rows[1:] == table["rows"], f"{doc.name}:{line}: figures differ from {target}"


def test_every_benchmark_table_names_its_file() -> None:
    bare = [line for kind, _, _, line in tables(REPO / "docs" / "benchmarks.md") if kind is None]
    assert not bare, f"docs/benchmarks.md tables without a source/inputs marker at lines {bare}"


def test_marked_inputs_exist() -> None:
    for doc in DOCS:
        for kind, target, _, line in tables(doc):
            if kind == "inputs":
                assert (REPO / str(target)).exists(), f"{doc.name}:{line}: no {target}"
