"""Shared by the bench scripts: run `nanoflex bench`'s measurement under several variants, and
write each figure table both to stdout (Markdown, for the docs) and to its results file.

A results file is {"table": {"header": [...], "rows": [[...]]}, "results": [...]}: the
table exactly as printed, and the raw measurements behind it. tests/test_doc_figures.py
checks that each docs table marked `<!-- source: bench/results/X.json -->` equals its file's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import LLM
from engine.throughput import run_bench
from policy import Policy
from policy.specs import WorkloadSpec


def parse_args(
    doc: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
) -> argparse.Namespace:
    """The shared bench flags; `extra` adds a script's own. `argv`: the command line after a
    subcommand (default: the process's)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument(
        "--num-prompts", type=int, default=0, help="default: one full block of each policy"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="runs per policy (median kept)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


Variant = Policy | str | tuple[Policy | str, dict[str, Any]]
"""A policy (or "auto"), optionally with engine switches that are not policy fields
(`LLM` keywords such as discrete_batching)."""


@dataclass
class Table:
    """A figure table: Markdown cells exactly as the docs show them."""

    header: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def markdown(self, align: str = "") -> str:
        """The Markdown table; `align` gives one of 'l'/'r' per column (default: all left)."""
        align = align or "l" * len(self.header)
        rule = ["---" if a == "l" else "---:" for a in align]
        lines = [self.header, rule, *self.rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def run_policies(
    variants: dict[str, Variant],
    args: argparse.Namespace,
    median_of: str = "generation_throughput",
) -> list[dict[str, Any]]:
    """One row per variant: the median (by the `median_of` metric) of `args.repeat` bench runs,
    interleaved across variants so slow drift of a shared machine hits them alike, and the
    cost model's prediction for the block the prompts ran in."""
    workload = WorkloadSpec(args.prompt_len, args.gen_len)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    predicted: dict[str, dict[str, Any] | None] = {}
    for _ in range(args.repeat):
        for name, variant in variants.items():
            policy, switches = variant if isinstance(variant, tuple) else (variant, {})
            with (
                tempfile.TemporaryDirectory(prefix="nanoflex-bench-") as offload,
                LLM(
                    args.model,
                    policy=policy,
                    offload_dir=offload,
                    device=args.device,
                    workload=workload,
                    **switches,
                ) as llm,
            ):
                num_prompts = args.num_prompts or llm.policy.block_size
                runs[name].append(run_bench(llm, args.prompt_len, args.gen_len, num_prompts))
                predicted[name] = runs[name][-1]["predicted"]  # for the block that ran
            print(f"{name}: run {len(runs[name])}/{args.repeat}", file=sys.stderr)
    rows = []
    for name, results in runs.items():
        ranked = sorted(results, key=lambda r: r[median_of])
        rows.append(
            {
                "name": name,
                "measured": ranked[len(ranked) // 2],
                "runs": results,
                "predicted": predicted[name],
            }
        )
    return rows


def source_trees(specs: list[str], this_tree: Path) -> list[tuple[str, str]]:
    """`--tree LABEL=DIR` values as (label, directory), each a nanoflex source tree (a
    checkout of an older commit, for a "before" figure); none given: `this_tree`."""
    trees = [(label, directory) for label, _, directory in (s.partition("=") for s in specs)]
    for label, directory in trees:
        if not (Path(directory) / "engine").is_dir():
            raise SystemExit(f"--tree {label}={directory}: not a nanoflex source tree")
    return trees or [("this tree", str(this_tree))]


def write_json(
    path: str | None,
    results: list[dict[str, Any]],
    table: Table,
    args: dict[str, Any] | None = None,
) -> None:
    """--json: the table as printed and the raw results behind it (and the command's
    arguments, when given), for bench/results/."""
    if path:
        data: dict[str, Any] = {"table": {"header": table.header, "rows": table.rows}}
        data |= {"results": results} | ({"args": args} if args is not None else {})
        with open(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
