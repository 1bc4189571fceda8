"""lm-evaluation-harness against a real `nanoflex serve`, and against its own `hf` model on
the same weights: the same accuracy, the same loglikelihoods within a stated tolerance.

    python -m bench.quality.lm_eval [--lm-eval /opt/venvs/lmeval/bin/lm_eval]
        [--json bench/results/lm-eval-cpu.json]

lm-eval lives in its own virtualenv, never a dependency of nanoflex:

    python3 -m venv /opt/venvs/lmeval
    /opt/venvs/lmeval/bin/pip install torch==2.13.0 "lm-eval[api]" transformers gguf accelerate

Two small local tasks (bench/quality/lm_eval_tasks.py writes their data and YAML): a multiple-choice
task scored by loglikelihood with 3 few-shot examples, whose questions share that few-shot
prefix (the prefix cache's case), and a `generate_until` task (stop at a newline). The
daemon runs the default model (SmolLM2-135M-Instruct, float32, prefix cache on) and lm-eval's
`local-completions` talks to it with the daemon's own tokenizer (`tokenizer_backend=remote`:
/tokenizer_info, /tokenize, /detokenize); the reference is lm-eval's `hf` model reading the
same converted checkpoint, float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.daemon.load import launch
from bench.quality.lm_eval_tasks import TASKS, write_tasks

LM_EVAL = "/opt/venvs/lmeval/bin/lm_eval"
SERVED = "smollm2-135m-instruct"
LOGLIKELIHOOD_TOLERANCE = 1e-3
"""Most a request's summed loglikelihood may differ from the hf model's (float32, nats)."""


def run_lm_eval(lm_eval: str, model: str, args: str, tasks_dir: Path, out: Path) -> Path:
    """One lm-eval run; returns its output folder (results and samples JSON)."""
    argv = [
        lm_eval,
        "run",
        "--model",
        model,
        "--model_args",
        args,
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(tasks_dir),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
        "--device",
        "cpu",
    ]
    subprocess.run(argv, check=True)
    return out


def read_run(out: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(results by task, samples by task) of one lm-eval output folder."""
    results_file = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(results_file.read_text())["results"]
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in TASKS:
        path = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return results, samples


def loglikelihoods(samples: list[dict[str, Any]]) -> list[float]:
    """Every (doc, choice) loglikelihood of a multiple-choice task, in order."""
    return [float(r[0][0]) for s in samples for r in s["resps"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", default=LM_EVAL)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from engine.loading.generated import local_model_dir

    model_dir = local_model_dir(None)
    with tempfile.TemporaryDirectory(prefix="nanoflex-lm-eval-") as tmp:
        scratch = Path(tmp)
        tasks_dir = write_tasks(scratch / "tasks")
        daemon, url = launch(scratch / "daemon", ["--dtype", "float32"])
        try:
            served = run_lm_eval(
                args.lm_eval,
                "local-completions",
                f"model={SERVED},base_url={url}/v1/completions,tokenizer_backend=remote,"
                "tokenized_requests=True,num_concurrent=4,max_retries=1",
                tasks_dir,
                scratch / "nanoflex",
            )
        finally:
            daemon.terminate()
            daemon.wait(60)
        reference = run_lm_eval(
            args.lm_eval,
            "hf",
            f"pretrained={model_dir},dtype=float32",
            tasks_dir,
            scratch / "hf",
        )
        ours, our_samples = read_run(served)
        theirs, their_samples = read_run(reference)
    table = Table(["task", "metric", "nanoflex", "hf", "largest loglikelihood difference (nats)"])
    rows: list[dict[str, Any]] = []
    for task, metric in TASKS.items():
        key = f"{metric},none"
        diff = None
        if metric == "acc":
            a, b = loglikelihoods(our_samples[task]), loglikelihoods(their_samples[task])
            assert len(a) == len(b)
            diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        row = {"task": task, "metric": metric, "nanoflex": ours[task][key], "hf": theirs[task][key]}
        row["max_loglikelihood_diff"] = diff
        rows.append(row)
        table.rows.append(
            [
                task,
                metric,
                f"{row['nanoflex']:.4f}",
                f"{row['hf']:.4f}",
                "-" if diff is None else f"{diff:.2e}",
            ]
        )
    print(table.markdown("llrrr"))
    write_json(args.json, rows, table)
    ok = all(r["nanoflex"] == r["hf"] for r in rows) and all(
        r["max_loglikelihood_diff"] is None or r["max_loglikelihood_diff"] < LOGLIKELIHOOD_TOLERANCE
        for r in rows
    )
    print("same accuracy, loglikelihoods within tolerance" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
