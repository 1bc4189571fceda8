"""Every docs table marked `<!-- source: bench/results/X.json -->`, generated from its file.

    python -m bench.tables --write [docs/benchmarks.md docs/policy.md ...]
    python -m bench.tables --check [docs/benchmarks.md ...]

A bench command writes its table into its results file as it prints it; `--write` copies
each such table into the docs (column alignment kept), `--check` writes nothing and exits 1
naming every table that differs from what `--write` would put there (tests/docs/test_tables.py
runs it). Without a path: every docs/*.md. Without a flag: `--write`.
"""

from __future__ import annotations

import argparse
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


def generate(text: str) -> tuple[str, list[str]]:
    """`text` with the table after each source marker generated from its results file, and
    the marked files whose table changed (in order)."""
    lines = text.splitlines()
    out: list[str] = []
    changed: list[str] = []
    i = 0
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
        new = render(table, old[1] if len(old) > 1 else "")
        if new != old:
            changed.append(match.group(1))
        out.extend(new)
    return "\n".join(out) + "\n", changed


def stale(path: Path) -> list[str]:
    """The marked results files whose table in `path` is not what they generate."""
    return generate(path.read_text())[1]


def write(path: Path) -> list[str]:
    """Rewrite the marked tables of `path` from their files; the files whose table changed."""
    text, changed = generate(path.read_text())
    if changed:
        path.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables (the default)")
    mode.add_argument("--check", action="store_true", help="only say which tables differ")
    parser.add_argument("paths", nargs="*", type=Path, help="default: every docs/*.md")
    args = parser.parse_args(argv)
    paths = args.paths or sorted((REPO / "docs").glob("*.md"))
    differ = 0
    for path in paths:
        changed = stale(path) if args.check else write(path)
        differ += len(changed)
        verb = "differs from" if args.check else "updated from"
        for source in changed:
            print(f"{path}: the table of {source} {verb} its results file")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
