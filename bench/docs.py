"""Rewrite every docs table marked `<!-- source: bench/results/X.json -->` from its file.

    python -m bench.docs [docs/benchmarks.md docs/policy.md ...]

A bench command writes its table into its results file as it prints it; this copies
each such table into the docs, column alignment kept. tests/test_doc_figures.py checks
they agree.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- source: (\S+) -->")


def render(table: dict[str, list], rule: str) -> list[str]:
    """The Markdown lines of `table`; `rule` is the old separator row (alignment), if any."""
    header = table["header"]
    cells = [c.strip() for c in rule.strip().strip("|").split("|")] if rule else []
    if len(cells) != len(header):
        cells = ["---"] * len(header)
    rows = [header, cells, *table["rows"]]
    return ["| " + " | ".join(row) + " |" for row in rows]


def update(path: Path) -> int:
    """Replace the table after each source marker in `path`; the number replaced."""
    lines = path.read_text().splitlines()
    out: list[str] = []
    i = count = 0
    while i < len(lines):
        out.append(lines[i])
        match = MARKER.fullmatch(lines[i].strip())
        i += 1
        if match is None:
            continue
        while i < len(lines) and not lines[i].startswith("|"):
            out.append(lines[i])
            i += 1
        old = []
        while i < len(lines) and lines[i].startswith("|"):
            old.append(lines[i])
            i += 1
        table = json.loads((REPO / match.group(1)).read_text())["table"]
        out.extend(render(table, old[1] if len(old) > 1 else ""))
        count += 1
    path.write_text("\n".join(out) + "\n")
    return count


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv or sys.argv[1:])] or sorted((REPO / "docs").glob("*.md"))
    for path in paths:
        if (n := update(path)) > 0:
            print(f"{path}: {n} table(s) updated from their results files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
