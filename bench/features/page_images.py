"""Page images through the Batch API against transformers: pages/s, tokens/s, valid outputs.

    python -m bench.features.page_images [--model DIR] [--pages 24] [--max-tokens 96]
        [--max-pixels 200704] [--json bench/results/page-images-cpu.json]

A folder of synthetic pages (bench/features/pages.py: letters, tables, receipts, seeded) is
sent as one Batch API job of chat completions (each line: the page as a data URL, a
document-extraction prompt, `response_format` a JSON schema, greedy) to a real `nanoflex
serve` on loopback (this tree's code, on the CPU, float32); then the same checkpoint, pages
and prompt run through transformers' `generate`, one page at a time, under the same schema
(llguidance's mask, as the engine applies it, in a logits processor). Reported for both:
pages/s and completion tokens/s over the whole folder (the job from its creation to its
completion; transformers' calls summed), how many outputs parse and validate under the
schema, and how many of nanoflex's answers are transformers' text.

Without `--model`, a tiny random Qwen2.5-VL (tests/engine/vision_models.py's, its image
processor's pixel budget raised to `--max-pixels`) stands in: the figures then measure the
serving path (preprocessing, the tower, the Batch API, constrained decoding), not a model.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.common import Table, write_json
from bench.daemon.load import launch, wait_for_batch
from bench.features.pages import render_pages

ROOT = Path(__file__).resolve().parents[2]
URL = "/v1/chat/completions"
PROMPT = (
    "Extract this document page as JSON: its kind (letter, table or receipt), its title or "
    "first heading, and its total amount in whole units (0 when it has none)."
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["letter", "table", "receipt"]},
        "title": {"type": "string", "maxLength": 24},
        "total": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["kind", "title", "total"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
"""The answer's schema, compact JSON (llguidance's option, which validators ignore: a random
model otherwise spends its tokens on whitespace the grammar allows between fields)."""


def tiny_checkpoint(folder: Path, max_pixels: int) -> Path:
    """The tests' tiny random Qwen2.5-VL, its image processor's budget `max_pixels` and its
    context 4096 tokens."""
    sys.path.insert(0, str(ROOT))
    from tests.engine.vision_models import build_tiny_vl

    path = build_tiny_vl(folder)
    config_path = path / "preprocessor_config.json"
    processor = json.loads(config_path.read_text())
    processor["size"]["longest_edge"] = max_pixels
    config_path.write_text(json.dumps(processor, indent=2))
    config_path = path / "config.json"  # room for a page's tokens (rotary: no new weights)
    config = json.loads(config_path.read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    config_path.write_text(json.dumps(config, indent=2))
    return path


def job_lines(pages: list[Path], model: str, max_tokens: int) -> bytes:
    """One chat completion line per page, its image as a data URL."""
    out = io.StringIO()
    for page in pages:
        url = "data:image/png;base64," + base64.b64encode(page.read_bytes()).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": PROMPT},
        ]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "page", "schema": SCHEMA},
            },
        }
        out.write(json.dumps({"custom_id": page.stem, "method": "POST", "url": URL, "body": body}))
        out.write("\n")
    return out.getvalue().encode()


def run_nanoflex(checkpoint: Path, pages: list[Path], max_tokens: int) -> dict[str, Any]:
    """The job on a fresh daemon: seconds from creation to completion, answers by page."""
    with tempfile.TemporaryDirectory(prefix="nanoflex-page-images-") as tmp:
        argv = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
        daemon, base = launch(Path(tmp), argv, tree=ROOT)
        try:
            with httpx.Client(base_url=base, timeout=600) as http:
                model = http.get("/v1/models").json()["data"][0]["id"]
                warm = json.loads(job_lines(pages[:1], model, 4).splitlines()[0])["body"]
                http.post(URL, json=warm).raise_for_status()  # first-request costs
                upload = http.post(
                    "/v1/files",
                    files={"file": ("pages.jsonl", job_lines(pages, model, max_tokens))},
                    data={"purpose": "batch"},
                )
                upload.raise_for_status()
                body = {"input_file_id": upload.json()["id"], "endpoint": URL}
                start = time.perf_counter()
                batch = http.post("/v1/batches", json={**body, "completion_window": "24h"})
                batch.raise_for_status()
                state = wait_for_batch(http, batch.json()["id"], 0.05)
                seconds = time.perf_counter() - start
                if state["status"] != "completed" or not state.get("output_file_id"):
                    errors = state.get("error_file_id")
                    detail = http.get(f"/v1/files/{errors}/content").text if errors else ""
                    raise RuntimeError(f"the job ended {state['status']}: {detail[:2000]}")
                output = http.get(f"/v1/files/{state['output_file_id']}/content").text
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    answers, tokens = {}, 0
    for line in output.splitlines():
        record = json.loads(line)
        response = record["response"]["body"]
        answers[record["custom_id"]] = response["choices"][0]["message"]["content"]
        tokens += response["usage"]["completion_tokens"]
    return {"seconds": seconds, "completion_tokens": tokens, "answers": answers}


def run_transformers(checkpoint: Path, pages: list[Path], max_tokens: int) -> dict[str, Any]:
    """Each page through transformers' greedy `generate` under the schema's mask."""
    from bench.features.hf_pages import HfPageReader

    reader = HfPageReader(checkpoint, json.dumps(SCHEMA))
    reader.answer(pages[0], PROMPT, 4)  # first-call costs
    answers, tokens, seconds = {}, 0, 0.0
    for page in pages:
        start = time.perf_counter()
        text, num_tokens = reader.answer(page, PROMPT, max_tokens)
        seconds += time.perf_counter() - start
        answers[page.stem], tokens = text, tokens + num_tokens
    return {"seconds": seconds, "completion_tokens": tokens, "answers": answers}


def valid(text: str) -> bool:
    """The answer parses as JSON and validates under the schema."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen2.5-VL directory (default: tiny)")
    parser.add_argument("--pages", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-pixels", type=int, default=448 * 448)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="page-images-") as tmp:
        folder = Path(tmp)
        pages = render_pages(folder / "pages", args.pages, args.seed)
        checkpoint = (
            Path(args.model) if args.model else tiny_checkpoint(folder / "tiny", args.max_pixels)
        )
        runs = {
            "nanoflex, Batch API": run_nanoflex(checkpoint, pages, args.max_tokens),
            "transformers generate": run_transformers(checkpoint, pages, args.max_tokens),
        }
    reference = runs["transformers generate"]["answers"]
    table = Table(
        ["system", "pages", "pages/s", "tokens/s", "valid under the schema", "same as transformers"]
    )
    results = []
    for name, run in runs.items():
        answers = run["answers"]
        num_valid = sum(valid(text) for text in answers.values())
        same = sum(answers.get(page.stem) == reference[page.stem] for page in pages)
        row = {
            "system": name,
            "pages": len(pages),
            "seconds": run["seconds"],
            "pages_per_s": len(pages) / run["seconds"],
            "tokens_per_s": run["completion_tokens"] / run["seconds"],
            "completion_tokens": run["completion_tokens"],
            "valid": num_valid,
            "same_as_transformers": same,
            "model": args.model or "tiny random Qwen2.5-VL",
        }
        results.append(row)
        table.rows.append(
            [
                name,
                str(len(pages)),
                f"{row['pages_per_s']:.2f}",
                f"{row['tokens_per_s']:.1f}",
                f"{num_valid}/{len(pages)}",
                f"{same}/{len(pages)}",
            ]
        )
    print(table.markdown("lrrrrr"))
    write_json(args.json, results, table, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
