"""What 4-bit weights and KV cost in accuracy on a trained model: top-1 agreement and perplexity.

    python -m bench.quality.compression [--model M] [--json FILE]

A fixed English text (TEXT, 338 tokens for SmolLM2) is scored teacher-forced by the engine
(`echo` with `logprobs`: the logprob of every token of the prompt and the most likely one),
one token per step (`max_step_tokens=1`): every position attends to all earlier ones through
the KV cache as stored, as a decode step of a generation does. For each variant: top-1
agreement with the float path (the share of positions whose most likely next token is
unchanged) and the perplexity of the text. The default model is the trained
SmolLM2-135M-Instruct; docs/compression.md quotes the result and
tests/engine/storage/test_compression_trained.py holds the tolerances.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from engine.core.model_files import served_model_name
from engine.core.tokenizer import Tokenizer
from engine.loading.generated import local_model_dir
from engine.storage.quant import dequantize, quantize
from policy import Policy

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. Her grandfather "
    "had kept the same light for forty years, and the logbook on the desk still held his "
    "careful handwriting: the weather, the ships that passed, the hours the lamp was lit. "
    "Most nights were quiet. Fishing boats came home before dark, and the ferry to the "
    "island crossed twice a day, at nine in the morning and at five in the afternoon. In "
    "winter, though, the storms arrived from the west without much warning. The wind bent "
    "the grass flat against the cliffs, and waves broke over the harbour wall. On those "
    "nights she stayed awake, checking the lens, the clockwork and the fuel, and writing "
    "down the time whenever a vessel's lights appeared on the horizon.\n\n"
    "Scientists who study the ocean measure its temperature, its salt content and the speed "
    "of its currents. Warm water from the tropics flows north along the surface, cools, "
    "sinks and returns south in the deep. This slow circulation moves heat around the "
    "planet and shapes the climate of entire continents. Small changes in it can bring "
    "colder winters to one country and droughts to another, which is why researchers "
    "place floating instruments across every sea and collect their data by satellite.\n\n"
    "To bake a simple loaf of bread, mix five hundred grams of flour with a teaspoon of "
    "salt, a packet of dried yeast and about three hundred millilitres of warm water. "
    "Knead the dough for ten minutes until it is smooth and elastic, then leave it in a "
    "covered bowl for an hour, or until it has doubled in size. Shape it, let it rise "
    "again, and bake it in a hot oven for thirty to thirty-five minutes."
)

ONE = Policy(gpu_batch_size=1)  # one sequence, so a step can be one token
VARIANTS: dict[str, Policy] = {
    "float": ONE,
    "4-bit weights": replace(ONE, compress_weights=True),
    "4-bit KV": replace(ONE, compress_kv=True),
    "4-bit KV, CPU attention": replace(
        ONE, compress_kv=True, kv_frac=(0.0, 1.0, 0.0), cpu_attention=True
    ),
    "4-bit weights and KV": replace(ONE, compress_weights=True, compress_kv=True),
}


class Scored(NamedTuple):
    """A teacher-forced pass over the text: per position after the first, the most likely
    token and the log-probability of the text's actual token."""

    top1: list[int]
    logprobs: list[float]


def score(model: str | None, policy: Policy, step_tokens: int | None = 1) -> Scored:
    """The engine on TEXT under `policy`, `step_tokens` per step (None: one prefill step)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, echo=True)
    with LLM(model, policy=policy, device="cpu", max_step_tokens=step_tokens) as llm:
        entries = llm.generate(TEXT, params)[0].prompt_logprobs
    assert entries is not None
    return Scored([e.top[0][0] for e in entries], [e.logprob for e in entries])


def score_transformers(model: str | None, weight_group_dim: int | None = None) -> Scored:
    """transformers' full forward over TEXT; with `weight_group_dim`, every matrix of the
    decoder layers and of the (untied) head first goes through the engine's 4-bit round trip,
    groups of 64 along that dimension (0, the output channel, is what the engine stores)."""
    from transformers import AutoModelForCausalLM

    model_dir = local_model_dir(model)
    ids = torch.tensor([Tokenizer(model_dir).encode(TEXT)])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        if weight_group_dim is not None:
            hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.clone())  # untie
            for module in hf.modules():
                if isinstance(module, torch.nn.Linear):
                    quantized = quantize(module.weight, group_size=64, dim=weight_group_dim)
                    module.weight.copy_(dequantize(quantized))
        log_probs = torch.log_softmax(hf(ids).logits[0, :-1], dim=-1)
    actual = log_probs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
    return Scored(log_probs.argmax(-1).tolist(), actual.tolist())


def compare(base: Scored, got: Scored) -> dict[str, float]:
    """Top-1 agreement of `got` with `base`, and the perplexity of the text under `got`."""
    same = sum(b == g for b, g in zip(base.top1, got.top1, strict=True))
    nll = -sum(got.logprobs) / len(got.logprobs)
    return {
        "top1_agreement": round(same / len(got.top1), 4),
        "perplexity": round(math.exp(nll), 3),
    }


def measure(model: str | None = None, variants: dict[str, Policy] = VARIANTS) -> dict[str, Any]:
    """Every variant scored on TEXT, compared with the first (the float path); then the same
    measure on transformers with 4-bit weights grouped either way, as a cross-check."""
    scored = {name: score(model, policy) for name, policy in variants.items()}
    base = next(iter(scored.values()))
    reference = {
        "4-bit weights, groups along the output channel (the engine's)": score_transformers(
            model, weight_group_dim=0
        ),
        "4-bit weights, groups along the input channel": score_transformers(
            model, weight_group_dim=1
        ),
    }
    return {
        "model": served_model_name(model),
        "model_dir": local_model_dir(model).name,
        "num_positions": len(base.top1),
        "tokens_per_step": 1,
        "policy": ONE.to_dict(),
        "variants": {name: compare(base, got) for name, got in scored.items()},
        "transformers": {name: compare(base, got) for name, got in reference.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.model)
    result["command"] = "python -m bench.quality.compression " + " ".join(argv or sys.argv[1:])
    result["device"] = "cpu, float32"
    table = quality_table(result)
    print(json.dumps(result, indent=2), file=sys.stderr)
    print(table.markdown("lrrr"))
    write_json(args.json, [result], table)
    return 0


def quality_table(result: dict[str, Any]) -> Table:
    """Top-1 agreement and perplexity per variant, and perplexity against float's."""
    rows = {
        **result["variants"],
        **{f"transformers, {k}": v for k, v in result["transformers"].items()},
    }
    base = next(iter(result["variants"].values()))["perplexity"]
    table = Table(["variant", "top-1 agreement", "perplexity", "vs float"])
    for name, row in rows.items():
        ppl = row["perplexity"]
        table.rows.append([name, f"{row['top1_agreement']:.3f}", f"{ppl:.2f}", f"{ppl / base:.2f}"])
    return table


if __name__ == "__main__":
    sys.exit(main())
