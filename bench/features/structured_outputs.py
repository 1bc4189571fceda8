"""What structured outputs cost a step: grammar masks at 1, 64 and 256 constrained sequences.

    python -m bench.features.structured_outputs [--counts 1,64,256] [--max-tokens 64]
        [--dtype bfloat16] [--json bench/results/structured-outputs-cpu.json]

The default model, each sequence a chat asking for a list of records and constrained to a
JSON schema whose output outlasts `--max-tokens` (so that every sequence runs every step),
against the same prompts unconstrained with EOS ignored, in one process. On a CPU the engine
computes the masks after the layers, on the step's thread ("mask work": their share of the
constrained run's wall time); beside a GPU it computes them on a worker thread while the
layers run (`StepSampler.overlap_masks`), measured here too: on a CPU that worker takes a
core from the forward pass's threads.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from engine.core.structured import StructuredOutput
from engine.executor.step_sampler import StepSampler

RECORDS = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
        "required": ["id", "name", "tags"],
    },
}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,64,256")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(None, dtype=args.dtype, max_step_tokens=4096)
    assert llm.tokenizer is not None
    sampler = llm.executor.sampler
    assert isinstance(sampler, StepSampler)
    chat = [{"role": "user", "content": "List many records of people as JSON."}]
    prompt = llm.tokenizer.apply_chat_template(chat)
    spec = StructuredOutput("json", json.dumps(RECORDS))
    llm.generate([prompt], SamplingParams(max_tokens=4, structured=spec))  # warm up
    table = Table(
        [
            "sequences",
            "plain tok/s",
            "constrained tok/s",
            "mask work",
            "constrained, masks beside the layers",
            "their exposed part",
        ]
    )
    results: list[dict[str, Any]] = []
    for count in map(int, args.counts.split(",")):
        prompts = [prompt] * count
        plain_s, plain_n = run(
            llm, prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        )
        constrained = SamplingParams(max_tokens=args.max_tokens, structured=spec)
        row: dict[str, Any] = {"sequences": count, "plain_tok_s": plain_n / plain_s}
        row["dtype"] = args.dtype
        for overlap in (False, True):  # the engine's CPU setting first, then the GPU's
            sampler.overlap_masks = overlap
            sampler.mask_seconds = sampler.mask_wait_seconds = 0.0
            seconds, tokens = run(llm, prompts, constrained)
            key = "overlapped" if overlap else "serial"
            row[f"{key}_tok_s"] = tokens / seconds
            row[f"{key}_mask_share"] = sampler.mask_seconds / seconds
            row[f"{key}_exposed_share"] = sampler.mask_wait_seconds / seconds
        sampler.overlap_masks = False
        results.append(row)
        table.rows.append(
            [
                str(count),
                f"{row['plain_tok_s']:.1f}",
                f"{row['serial_tok_s']:.1f}",
                f"{100 * row['serial_mask_share']:.1f}%",
                f"{row['overlapped_tok_s']:.1f}",
                f"{100 * row['overlapped_exposed_share']:.1f}%",
            ]
        )
    llm.close()
    print(table.markdown("rrrrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
