"""Turn bench/results/gpu-*.json into the docs/benchmarks.md tables and PNG plots.

    python -m bench.gpu.report [--results-dir bench/results] [--update-docs docs/benchmarks.md]
        [--plots-dir docs/img]

Prints two Markdown tables: the comparison (generation throughput of each system and
the ratios nanoflex / FlexGen, nanoflex / Accelerate, nanoflex / roofline) and the
nanoflex ablations. With --update-docs the tables replace the text between the
`<!-- gpu-results:begin -->` and `<!-- gpu-results:end -->` markers. Plots
(throughput against block size; latency against throughput, like FlexGen's Fig. 1)
need matplotlib; without it they are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"


def load_results(results_dir: Path) -> list[dict[str, Any]]:
    """The comparison records (bench.gpu.compare's, with a case and its runs) among
    gpu-*.json; the suite, profile and overlap records beside them are not cases."""
    records = [json.loads(p.read_text()) for p in sorted(results_dir.glob("gpu-*.json"))]
    return [r for r in records if "case" in r and "runs" in r]


def _gen(run: dict[str, Any] | None) -> float | None:
    if not run or not run.get("ok"):
        return None
    value = run.get("metrics", {}).get("generation_throughput")
    return float(value) if value is not None else None


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _policy(p: dict[str, Any] | None) -> str:
    """FlexGen's tuple: (gbs x #gb, wg, wc, cg, cc, hg, hc) in percent, plus switches."""
    if not p:
        return "-"
    w, c, h = p["weights_frac"], p["kv_frac"], p["act_frac"]
    pct = ", ".join(f"{round(100 * x)}" for x in (w[0], w[1], c[0], c[1], h[0], h[1]))
    flags = [
        name
        for name, on in (
            ("CPU attn", p.get("cpu_attention")),
            ("4-bit w", p.get("compress_weights")),
            ("4-bit KV", p.get("compress_kv")),
            ("no overlap", not p.get("overlap", True)),
        )
        if on
    ]
    return f"{p['gpu_batch_size']}x{p['num_gpu_batches']}, {pct}" + (
        f"; {', '.join(flags)}" if flags else ""
    )


def _budget(case: dict[str, Any]) -> str:
    return "whole card" if case.get("gpu_mem") is None else f"{case['gpu_mem'] / 2**30:.0f} GiB"


def comparison_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | GPU budget | nanoflex | FlexGen | Accelerate | predicted | roofline | "
        "nanoflex / FlexGen | nanoflex / Accelerate | nanoflex / roofline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        case, runs = r["case"], r.get("runs", {})
        nano = _gen(runs.get("nanoflex:auto"))
        flexgen = _gen(runs.get("flexgen"))
        accelerate = _gen(runs.get("accelerate"))
        predicted = r.get("predicted", {}).get("nanoflex:auto", {}).get("generation_throughput")
        best = (r.get("roofline") or {}).get("best") or {}
        bound = best.get("bound")
        lines.append(
            f"| {case['name']} | {_budget(case)} | {_fmt(nano)} | {_fmt(flexgen)} | "
            f"{_fmt(accelerate)} | {_fmt(predicted)} | {_fmt(bound)} | {_ratio(nano, flexgen)} | "
            f"{_ratio(nano, accelerate)} | {_ratio(nano, bound)} |"
        )
    return "\n".join(lines)


def policy_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | system | policy (gbs x #gb, wg, wc, cg, cc, hg, hc) | generation | prefill | "
        "decode | limit (cost model / roofline) |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        case, runs = r["case"], r.get("runs", {})
        best = (r.get("roofline") or {}).get("best") or {}
        for name, run in runs.items():
            m = run.get("metrics", {}) if run.get("ok") else {}
            if name == "accelerate":
                policy = f"batch {run.get('batch_size', '-')}, device_map auto"
            else:
                policy = _policy(run.get("policy"))
            limit = r.get("predicted", {}).get(name, {}).get("bottleneck", "-")
            if name == "nanoflex:auto":
                limit += f" / {best.get('limit', '-')}"
            status = "" if run.get("ok") else f" ({_short(run.get('error') or 'failed')})"
            lines.append(
                f"| {case['name']} | {name}{status} | {policy} | "
                f"{_fmt(m.get('generation_throughput'))} | "
                f"{_fmt(m.get('prefill_throughput'), 1)} | "
                f"{_fmt(m.get('decode_throughput'))} | {limit} |"
            )
    return "\n".join(lines)


def _short(error: str, most: int = 90) -> str:
    """An error's first line, cut after the last sentence that ends within `most` characters
    (CUDA's out-of-memory message runs to 600)."""
    line = error.splitlines()[0]
    if len(line) <= most:
        return line
    end = line.rfind(". ", 0, most)
    return line[: end + 1] if end > 0 else line[:most] + "..."


def device_line(results: list[dict[str, Any]]) -> str:
    notes = {r.get("hardware", {}).get("notes", "") for r in results} - {""}
    return "Device: " + ("; ".join(sorted(notes)) if notes else "unknown (no profile cached)")


SOURCES = ("report-gpu-throughput.json", "report-gpu-policies.json")
"""Where --update-docs leaves each table as {"table": {"header", "rows"}} beside the results,
for the docs' figure check (tests/test_doc_figures.py)."""


def report(results: list[dict[str, Any]], sources: Path | None = None) -> str:
    """The device, the throughput table and the policy table; with `sources` (the results
    directory) each table is preceded by its source marker."""

    def marked(name: str, table: str) -> str:
        return table if sources is None else f"<!-- source: {sources / name} -->\n{table}"

    return "\n\n".join(
        [
            device_line(results),
            "Generation throughput (token/s), one block per system:",
            marked(SOURCES[0], comparison_table(results)),
            "Policies and all runs (nanoflex variants are the ablations):",
            marked(SOURCES[1], policy_table(results)),
        ]
    )


def table_record(markdown: str) -> dict[str, Any]:
    """A Markdown table as {"table": {"header", "rows"}} (cells stripped, rule row dropped)."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("|")
    ]
    rows = [r for r in rows if not all(c and set(c) <= set(":-") for c in r)]
    return {"table": {"header": rows[0], "rows": rows[1:]}}


def update_docs(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} lacks the {BEGIN} / {END} markers")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def points(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(case, system, block size, latency s, generation token/s) of every successful run."""
    out = []
    for r in results:
        for name, run in r.get("runs", {}).items():
            m = run.get("metrics", {})
            if not run.get("ok") or "generation_throughput" not in m:
                continue
            block = m.get("num_prompts") or (run.get("policy") or {}).get("gpu_batch_size", 1)
            latency = m.get("prefill_seconds", 0.0) + m.get("decode_seconds", 0.0)
            out.append(
                dict(case=r["case"]["name"], system=name, block=block, latency=latency,
                     throughput=m["generation_throughput"])
            )  # fmt: skip
    return out


def plot(results: list[dict[str, Any]], plots_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped", file=sys.stderr)
        return []
    rows = points(results)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, x_key, x_label in (
        ("gpu-throughput-vs-block-size.png", "block", "block size (sequences)"),
        ("gpu-latency-vs-throughput.png", "latency", "latency of one block (s)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for case in sorted({p["case"] for p in rows}):
            for system in sorted({p["system"] for p in rows if p["case"] == case}):
                sel = [p for p in rows if p["case"] == case and p["system"] == system]
                ax.scatter([p[x_key] for p in sel], [p["throughput"] for p in sel],
                           label=f"{case} {system}", s=25)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("generation throughput (token/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
        fig.tight_layout()
        fig.savefig(plots_dir / name, dpi=120)
        plt.close(fig)
        written.append(plots_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--update-docs", type=Path, default=None)
    parser.add_argument("--plots-dir", type=Path, default=Path("docs/img"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    results = load_results(args.results_dir)
    if not results:
        print(f"no gpu-*.json in {args.results_dir}", file=sys.stderr)
        return 1
    text = report(results, args.results_dir if args.update_docs else None)
    print(text)
    if args.update_docs:
        for name, table in zip(SOURCES, (comparison_table(results), policy_table(results))):
            path = args.results_dir / name
            path.write_text(json.dumps(table_record(table), indent=1) + "\n")
        update_docs(args.update_docs, text)
    if not args.no_plots:
        for path in plot(results, args.plots_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
