"""How much of a layer's weight copy hides behind compute on this device, two ways.

    python -m bench.gpu.overlap [--device cuda] [--layers 6] [--seqs 64] [--prompt-len 256]
        [--json bench/results/gpu-overlap.json]

1. The hardware alone (CUDA only): one Llama-3-8B layer's weights (436 MB in float16) copied
   host to device on a side stream while GEMMs of about the same length run on the compute
   stream, timed with CUDA events. `hidden` = (copy + compute - both) / min(copy, compute):
   1.0 when the shorter one hides wholly behind the longer, 0.0 when they serialize. Three
   sources: pinned memory allocated once (FlexGen's way), pinned memory allocated for each
   copy (what `Device.host_empty` does per staging copy), and pageable memory.
2. The engine: a dummy Llama-3-8B shape cut to `--layers` layers, weights on the CPU tier,
   KV and activations on the device, one block of `--seqs` prompts, prefill in one step,
   then decode steps; overlap on and off, traced (`EngineArgs.trace`, device spans timed
   with CUDA events). `hidden` = (step without overlap - step with it) / min(the step's
   loads, its computes): the share of the shorter that overlap hid, for the prefill and for
   the decode steps; and whether the tokens agree between two runs of one engine and
   between overlap on and off.

The GPU pass (bench/gpu/pass.sh) runs it; on the CPU it runs the engine part on a small
shape as a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.profiling.copy_overlap import CopyBesideGemms, event_ms

LLAMA3_8B_LAYER_PARAMS = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
"""q, k, v, o and the three MLP projections of one Llama-3-8B layer."""


def hardware_overlap(layer_bytes: int, repeats: int = 5) -> dict[str, Any]:
    """Copy alone, GEMMs alone and both at once, per host-memory kind (median of `repeats`),
    through the profile's probe (engine/profiling/copy_overlap.py)."""
    device = torch.device("cuda", torch.cuda.current_device())
    probe = CopyBesideGemms(device)
    dst = torch.empty(layer_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(layer_bytes, dtype=torch.uint8)
    pinned.random_(0, 255)
    pageable.random_(0, 255)

    def copy_from(kind: str) -> Any:
        def run() -> None:
            if kind == "pinned-once":
                dst.copy_(pinned, non_blocking=True)
            elif kind == "pinned-per-copy":
                stage = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
                stage.copy_(pageable)
                dst.copy_(stage, non_blocking=True)
            else:
                dst.copy_(pageable, non_blocking=True)

        return run

    together = probe.measure(copy_from("pinned-once"), repeats)
    out: dict[str, Any] = {
        "layer_bytes": layer_bytes,
        "gemms": together.gemms,
        "compute_ms": together.compute_ms,
        "kinds": {},
    }
    for kind in ("pinned-once", "pinned-per-copy", "pageable"):
        alone = (
            together.copy_ms
            if kind == "pinned-once"
            else statistics.median(event_ms(copy_from(kind), probe.side) for _ in range(repeats))
        )
        row: dict[str, float] = {"copy_ms": alone, "copy_gb_s": layer_bytes / alone / 1e6}
        out["kinds"][kind] = row
        if kind == "pinned-once":
            # the others stall the host (the allocation, the staging memcpy) before the GEMMs
            # are even issued: their rate is the figure, an overlap share would not be
            row["both_ms"] = together.both_ms
            row["hidden"] = together.hidden
    return out


KIND_NAMES = {
    "pinned-once": "pinned once (FlexGen's way)",
    "pinned-per-copy": "pinned per copy (`Device.host_empty`'s staging today)",
    "pageable": "pageable",
}


def hardware_table(hardware: dict[str, Any]) -> dict[str, Any]:
    """The hardware part as printed and as docs/benchmarks.md shows it."""
    compute = hardware["compute_ms"]
    rows = []
    for kind, row in hardware["kinds"].items():
        if "hidden" in row:
            together = f"{row['both_ms']:.2f} ms: {row['hidden']:.0%} of the shorter hidden"
        else:
            together = "not measured: the host stalls before the GEMMs are issued"
        rows.append(
            [KIND_NAMES[kind], f"{row['copy_ms']:.2f} ms", f"{row['copy_gb_s']:.1f} GB/s", together]
        )
    header = [
        "host memory",
        "copy alone",
        "copy rate",
        f"copy and GEMMs together (GEMMs alone {compute:.2f} ms)",
    ]
    return {"header": header, "rows": rows}


def _llama_dir(root: Path, layers: int, small: bool) -> Path:
    from engine.loading.dummy import hf_config_dict

    config = hf_config_dict("llama-3-8b")
    config["num_hidden_layers"] = layers
    if small:  # the CPU dry run
        config.update(
            hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=1024,
        )  # fmt: skip
    path = root / f"llama-3-8b-{layers}l{'-small' if small else ''}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def step_times(events: list[dict[str, Any]], skip_steps: int = 0) -> list[dict[str, float]]:
    """Per step of a traced run (one GPU batch, so one compute and one weight load per layer
    and step; step k holds each layer's k-th of each), after `skip_steps` warm-up steps: its
    span on the device clock from the first load or compute to the last, and the sums of its
    loads and of its computes, in microseconds. The first step kept is the prefill."""
    by_layer: dict[str, dict[int, list[dict[str, Any]]]] = {"compute": {}, "load_weight": {}}
    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        if e["name"] in by_layer:
            by_layer[e["name"]].setdefault(e["args"]["layer"], []).append(e)
    steps = len(by_layer["compute"].get(0, []))
    out = []
    for k in range(skip_steps, steps):
        spans = {
            name: [runs[k] for runs in layers.values() if len(runs) > k]
            for name, layers in by_layer.items()
        }
        both = spans["compute"] + spans["load_weight"]
        out.append(
            {
                "span_us": max(e["ts"] + e["dur"] for e in both) - min(e["ts"] for e in both),
                "load_us": sum(e["dur"] for e in spans["load_weight"]),
                "compute_us": sum(e["dur"] for e in spans["compute"]),
            }
        )
    return out


def hidden_share(on: list[dict[str, float]], off: list[dict[str, float]]) -> dict[str, float]:
    """What overlap saved over what it could have: (step off - step on) / min(loads, computes)
    of the steps run without overlap, whose spans are clean (with overlap on, a compute span
    also holds its wait for its own layer's weights). 1.0: the shorter of the two wholly
    hidden; 0.0: nothing saved."""
    span_on, span_off = (sum(s["span_us"] for s in steps) for steps in (on, off))
    load, compute = (sum(s[key] for s in off) for key in ("load_us", "compute_us"))
    hideable = min(load, compute)
    return {
        "step_on_us": span_on,
        "step_off_us": span_off,
        "load_us": load,
        "compute_us": compute,
        "hidden": (span_off - span_on) / hideable if hideable else 0.0,
    }


def engine_overlap(
    device: str, layers: int, seqs: int, prompt_len: int, gen_len: int, small: bool
) -> dict[str, Any]:
    """Overlap on and off on the same block, each run twice in one engine (the first a
    warm-up): the hidden share of prefill and of decode steps, the wall times, and whether the
    tokens agree between the two runs of one engine (determinism) and between on and off."""
    from engine import LLM, SamplingParams
    from engine.executor.trace import Tracer
    from policy import Policy

    steps: dict[bool, list[dict[str, float]]] = {}
    tokens: dict[bool, list[list[list[int]]]] = {}
    wall: dict[bool, float] = {}
    with tempfile.TemporaryDirectory(prefix="nanoflex-overlap-") as tmp:
        model = _llama_dir(Path(tmp), layers, small)
        g = torch.Generator().manual_seed(0)
        vocab = 1024 if small else 128256
        prompts = [
            torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(seqs)
        ]
        params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
        for overlap in (True, False):
            path = Path(tmp) / f"trace-{overlap}.json"
            policy = Policy(gpu_batch_size=seqs, weights_frac=(0.0, 1.0, 0.0), overlap=overlap)
            with LLM(
                f"dummy:{model}",
                policy=policy,
                device=device,
                max_step_tokens=seqs * prompt_len,
                trace=str(path),
            ) as llm:
                runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)]]
                tracer = llm.executor.tracer
                assert isinstance(tracer, Tracer)
                spans = tracer.spans
                warm = sum(sp.name == "compute" and sp.args["layer"] == 0 for sp in spans)
                start = time.perf_counter()
                runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
                wall[overlap] = time.perf_counter() - start
            tokens[overlap] = runs
            steps[overlap] = step_times(json.loads(path.read_text())["traceEvents"], warm)
    return {
        "prefill": hidden_share(steps[True][:1], steps[False][:1]),
        "decode": hidden_share(steps[True][1:], steps[False][1:]),
        "wall_on_s": wall[True],
        "wall_off_s": wall[False],
        "deterministic": {
            "on": tokens[True][0] == tokens[True][1],
            "off": tokens[False][0] == tokens[False][1],
        },
        "on_equals_off": tokens[True][1] == tokens[False][1],
        "first_difference": _first_difference(tokens[True][1], tokens[False][1]),
    }


def _first_difference(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """[sequence, token] of the first token where two runs differ; None when they agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for t, (u, v) in enumerate(zip(x, y, strict=True)):
            if u != v:
                return [i, t]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }
    if cuda:
        record["hardware"] = hardware_overlap(LLAMA3_8B_LAYER_PARAMS * 2)
        record["table"] = hardware_table(record["hardware"])
        print(" | ".join(record["table"]["header"]))
        for cells in record["table"]["rows"]:
            print(" | ".join(cells))
    record["engine"] = engine_overlap(
        args.device, args.layers, args.seqs, args.prompt_len, args.gen_len, small=not cuda
    )
    engine = record["engine"]
    for phase in ("prefill", "decode"):
        row = engine[phase]
        print(
            f"engine {phase:7s} step on {row['step_on_us'] / 1e3:7.1f} ms, off "
            f"{row['step_off_us'] / 1e3:7.1f} ms, loads {row['load_us'] / 1e3:7.1f} ms, computes "
            f"{row['compute_us'] / 1e3:7.1f} ms: hidden {row['hidden']:.2f}"
        )
    print(
        f"engine wall on {engine['wall_on_s']:.2f} s, off {engine['wall_off_s']:.2f} s; "
        f"deterministic {engine['deterministic']}; on == off {engine['on_equals_off']} "
        f"(first difference {engine['first_difference']})"
    )
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
