"""`nanoflex plan`: choose a policy for a model, workload and machine, and say why."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from policy.catalog import resolve_model_spec
from policy.dtypes import DTYPE_BYTES, DTYPES, default_dtype
from policy.hardware import HardwareSpec, load_cached
from policy.moe import ExpertStage, experts_per_tier
from policy.policy import Policy
from policy.prefix import break_even_tokens
from policy.search import PlanResult
from policy.search_cache import cached_search
from policy.specs import ModelSpec, WorkloadSpec
from policy.state_cost import state_bytes_per_tier, state_summary
from policy.units import format_bytes, parse_bytes
from policy.vision import DEFAULT_IMAGE_PIXELS
from policy.vision_report import image_note, vision_lines, vision_summary

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model `nanoflex serve` runs when none is named (engine/core/model_files.py)."""

TASK_LABELS: dict[str, str] = {
    "ctog": "CPU->GPU copies (weights, KV, activations)",
    "gtoc": "GPU->CPU copies (new KV, activations, q/k/v for CPU attention)",
    "dtoc": "disk reads",
    "ctod": "disk writes",
    "gpu_compute": "GPU compute (matmuls, attention, dequantization)",
    "cpu_compute": "CPU attention",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="path, hub id or built-in name (nanoflex-demo, opt-30b, llama-3-8b, mixtral-8x7b, "
        "qwen3-30b-a3b, ...)",
    )
    add_length_args(parser)
    add_image_args(parser)
    parser.add_argument("--gpu-mem", default=None, help="GPU budget, e.g. 16GiB")
    parser.add_argument("--cpu-mem", default=None, help="CPU memory budget, e.g. 64GiB")
    parser.add_argument("--disk-mem", default=None, help="disk budget, e.g. 500GiB")
    parser.add_argument("--hardware", default=None, help="hardware JSON (default: cached profile)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the compute dtype to price, as `nanoflex serve --dtype` (default: the engine's on "
        "the profile's compute device: float32 on a CPU, unless it has bfloat16 in hardware "
        "and the checkpoint is half precision; the checkpoint's half type on CUDA)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def add_length_args(parser: argparse.ArgumentParser) -> None:
    """The workload's lengths, in vLLM's words (`--input-len`, `--output-len`) with FlexGen's
    (`--prompt-len`, `--gen-len`) kept as aliases; parsed as `prompt_len` and `gen_len`."""
    parser.add_argument(
        "--input-len",
        "--prompt-len",
        dest="prompt_len",
        metavar="N",
        type=int,
        default=512,
        help="prompt tokens per request (--prompt-len: FlexGen's name)",
    )
    parser.add_argument(
        "--output-len",
        "--gen-len",
        dest="gen_len",
        metavar="N",
        type=int,
        default=32,
        help="tokens generated per request, EOS ignored (--gen-len: FlexGen's name)",
    )


def add_image_args(parser: argparse.ArgumentParser) -> None:
    """A vision model's images per prompt, parsed as `images_per_request` and
    `pixels_per_image` (a text model ignores them)."""
    parser.add_argument(
        "--images-per-request",
        dest="images_per_request",
        metavar="N",
        type=float,
        default=0.0,
        help="images in each prompt, for a vision model (default 0.0: text prompts)",
    )
    parser.add_argument(
        "--image-pixels",
        dest="pixels_per_image",
        metavar="N",
        type=float,
        default=DEFAULT_IMAGE_PIXELS,
        help=f"pixels of each image (default {DEFAULT_IMAGE_PIXELS}: 1024 x 1024)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the search for the parsed `nanoflex plan` arguments; print JSON or a report."""
    hardware = HardwareSpec.load(args.hardware) if args.hardware else load_cached()
    model = engine_priced(resolve_model_spec(args.model), hardware.compute_device, args.dtype)
    workload = WorkloadSpec(
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        images_per_request=args.images_per_request,
        pixels_per_image=args.pixels_per_image,
    ).priced_for(model)
    if hardware.compute_device == "cpu" and args.cpu_mem is not None:
        print(cpu_only_note(args.hardware), file=sys.stderr)
    result = cached_search(
        model,
        workload,
        hardware,
        gpu_mem=None if args.gpu_mem is None else parse_bytes(args.gpu_mem),
        cpu_mem=None if args.cpu_mem is None else parse_bytes(args.cpu_mem),
        disk_mem=None if args.disk_mem is None else parse_bytes(args.disk_mem),
    )
    break_even = break_even_tokens(model, hardware, compress_kv=result.policy.compress_kv)
    if args.json:
        out = {**result.to_dict(), "prefix_break_even_tokens": break_even}
        out["workload"] = {"prompt_len": workload.prompt_len, "gen_len": workload.gen_len}
        out["dtype_bytes"] = model.dtype_bytes
        if model.vision is not None:
            out["vision"] = vision_summary(model, workload, result)
        if model.is_moe:
            out["moe"] = moe_summary(model, result)
        if model.is_hybrid:
            out["states"] = state_summary(model, result.policy, result.estimate.peak_bytes)
        print(json.dumps(out, indent=2))
    else:
        print(format_report(model, workload, result, break_even))
    return 0


def engine_priced(model: ModelSpec, compute_device: str, dtype: str | None) -> ModelSpec:
    """`model` with the element size the engine computes in on `compute_device`: `dtype` if
    given, else the engine's default (policy/dtypes.py) for a checkpoint of the spec's
    element size; a CPU without bfloat16 in hardware computes a half checkpoint in float32,
    twice its bytes (engine/core/auto_policy.py prices the same for `--policy auto`)."""
    checkpoint = "float16" if model.dtype_bytes == 2 else "float32"
    chosen = dtype or default_dtype(compute_device, checkpoint)
    return dataclasses.replace(model, dtype_bytes=DTYPE_BYTES[chosen])


def cpu_only_note(hardware_file: str | None) -> str:
    """Why --cpu-mem plans nothing on a profile whose compute device is the CPU."""
    whose = f"the profile {hardware_file}" if hardware_file else "this machine's profile"
    return (
        f"nanoflex plan: note: {whose} has no GPU: the compute device is the CPU, its memory "
        "is the gpu tier (--gpu-mem) and there is no separate cpu tier, so --cpu-mem is not "
        "used. To plan for a GPU box, run `nanoflex profile` there and pass its "
        "hardware.json (in its nanoflex cache) with --hardware FILE."
    )


def _window_note(model: ModelSpec) -> str:
    """How much of the KV a sliding window spares the attention."""
    if not model.num_local_layers:
        return ""
    return (
        f" ({model.num_local_layers} of {model.num_layers} layers attend over their last "
        f"{model.sliding_window} tokens only)"
    )


def _state_note(model: ModelSpec) -> str:
    """A hybrid's state beside its KV: the KV's layers, the state's size per sequence."""
    if not model.is_hybrid:
        return ""
    per_sequence = model.state_bytes_per_sequence
    beside = ", beside attention" if model.parallel_hybrid else ""
    return (
        f" in {model.num_kv_layers} of {model.num_layers} layers; "
        f"{format_bytes(per_sequence)} of state per sequence in {model.num_state_layers}{beside} "
        f"(as much as {per_sequence / model.kv_bytes_per_token:,.0f} tokens of KV)"
    )


def _pooling_note(model: ModelSpec) -> str:
    """How a pooling model's requests are priced."""
    if not model.pooling:
        return ""
    head = "no LM head" if model.pooling == "embed" else "a one-row classifier for its LM head"
    return (
        f" (a pooling model, {model.pooling}: a prefill only, its last position's head row "
        f"the answer; {head}; throughputs count prompt tokens and sequences, not a decode)"
    )


def _triple(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{100 * v:.1f}%" for v in values)


def format_report(
    model: ModelSpec,
    workload: WorkloadSpec,
    result: PlanResult,
    break_even: dict[str, int | None],
) -> str:
    """A readable plan: the policy, the prediction, and the reasons behind each choice."""
    policy, est = result.policy, result.estimate
    stage, _, task = result.bottleneck.partition(" ")[0].partition(":")
    active = f" ({model.active_params / 1e9:.2f}B active per token)" if model.is_moe else ""
    lines = [
        f"model {model.name}: {model.total_params / 1e9:.2f}B parameters{active}, "
        f"{format_bytes(model.total_weight_bytes)} of weights, "
        f"{format_bytes(model.kv_bytes_per_token)} of KV per token{_window_note(model)}"
        + _state_note(model),
        f"priced in {model.dtype_bytes}-byte elements (the engine's compute dtype; --dtype)",
        *vision_lines(model, workload, result),
        f"workload: prompt {workload.prompt_len:g} tokens, generate {workload.gen_len:g}"
        + _pooling_note(model)
        + image_note(model, workload),
        "",
        "policy (gpu / cpu / disk):",
        f"  block           {policy.gpu_batch_size} x {policy.num_gpu_batches} GPU batches "
        f"= {policy.block_size} sequences",
        f"  weights         {_triple(policy.weights_frac)}"
        + (" (all but the routed experts)" if model.is_moe else ""),
        *_expert_rows(model, policy),
        f"  KV cache        {_triple(policy.kv_frac)}",
        f"  activations     {_triple(policy.act_frac)}",
        f"  cpu attention   {'on' if policy.cpu_attention else 'off'}",
        f"  4-bit weights   {'on' if policy.compress_weights else 'off'}",
        f"  4-bit KV        {'on' if policy.compress_kv else 'off'}",
        f"  nano-batches    {policy.num_nano_batches}",
        f"  threads         {policy.num_cpu_threads} intra-op, {policy.num_load_threads} load, "
        f"{policy.num_store_threads} store, {policy.num_copy_threads} disk",
        "",
        "predicted throughput (tokens/s):",
        f"  prefill {result.predicted['prefill_throughput']:.2f}, "
        f"decode {result.predicted['decode_throughput']:.2f}, "
        f"generation {result.predicted['generation_throughput']:.2f}",
        "",
        "memory (peak / usable):",
    ]
    states = state_bytes_per_tier(model, policy)
    for tier in ("gpu", "cpu", "disk"):
        share = states[tier] / est.peak_bytes[tier] if est.peak_bytes[tier] else 0.0
        lines.append(
            f"  {tier:5s} {format_bytes(est.peak_bytes[tier]):>10s} / "
            f"{format_bytes(est.capacity_bytes[tier])}"
            + (f", states {format_bytes(states[tier])} ({share:.0%})" if states[tier] else "")
        )
    lines += ["", "why:", f"  bottleneck: {stage} is limited by {TASK_LABELS.get(task, task)}"]
    if "memory full" in result.bottleneck:
        lines.append(
            "  " + result.bottleneck.split("(", 1)[1].rstrip(")") + ": a bigger block would not fit"
        )
    terms = est.decode_terms if stage == "decode" else est.prefill_terms
    per_layer = ", ".join(f"{t} {1e3 * v:.1f} ms" for t, v in terms.items())
    lines.append(f"  per-layer {stage} times: {per_layer}")
    lines += _nano_reasons(result)
    lines += _moe_reasons(model, result)
    best = result.predicted["generation_throughput"]
    for combo, throughput in sorted(result.alternatives.items(), key=lambda kv: -kv[1]):
        lines.append(f"  best with {combo}: {throughput:.2f} tok/s ({throughput / best:.0%})")
    lines += ["", "prefix cache: a cached prefix is loaded back instead of recomputed from"]
    if model.is_hybrid:
        lines[-1] += " (with the state saved at its end)"
    for tier, tokens in break_even.items():
        when = "never (recomputing is faster)" if tokens is None else f"{tokens} tokens"
        lines.append(f"  {tier:5s} {when}")
    return "\n".join(lines)


def _nano_reasons(result: PlanResult) -> list[str]:
    """Why this many nano-batches: what cutting costs, what overlap hides, and the other
    counts' predictions for the same placement (docs/policy.md, Nano-batches)."""
    chosen = result.policy.num_nano_batches
    one, this = result.nano_estimates[1], result.nano_estimates[chosen]
    ms = 1e3
    parts = this.compute_parts
    attention = f"attention {ms * parts['gpu_attention']:.2f} ms on the compute device"
    if parts["cpu_attention"]:
        attention += f" and {ms * parts['cpu_attention']:.2f} ms on the CPU"
    if chosen == 1:
        head = "  nano-batches: 1, cutting the GPU batch costs more than overlap would hide"
    else:
        overhead = parts["dense"] - one.compute_parts["dense"]
        head = (
            f"  nano-batches: {chosen}; per decode layer, dense ops {ms * parts['dense']:.2f} ms "
            f"({ms * overhead:.2f} ms of it the cost of cutting),\n    {attention}; "
            f"overlapped, compute takes {ms * this.decode_terms['compute']:.2f} ms, not "
            f"{ms * one.decode_terms['compute']:.2f} ms in one piece"
        )
    others = ", ".join(
        f"{n}: {est.generation_throughput:.2f} tok/s" + (" (chosen)" if n == chosen else "")
        for n, est in sorted(result.nano_estimates.items())
    )
    return [head, f"  nano-batches, same placement: {others}"]


def _expert_rows(model: ModelSpec, policy: Policy) -> list[str]:
    """The routed experts' placement, per MoE layer, for the policy block of the report."""
    if not model.is_moe:
        return []
    gpu, cpu, disk = experts_per_tier(model, policy)
    return [
        f"  routed experts  {_triple(policy.experts_frac)}: {gpu} / {cpu} / {disk} of "
        f"{model.num_experts} per MoE layer",
        f"  cpu experts     {'on' if policy.cpu_experts else 'off'}",
    ]


def _stage_line(model: ModelSpec, name: str, stage: ExpertStage, policy: Policy) -> str:
    copied = 1.0 - policy.experts_frac[0] - (policy.experts_frac[1] if stage.cpu_compute else 0)
    grouped = "the block" if stage.num_groups == 1 else f"each of {stage.num_groups} GPU batches"
    return (
        f"  {name}: {stage.num_tokens:.0f} tokens per layer touch {stage.distinct_experts:.2f} "
        f"of {model.num_experts} experts, {format_bytes(stage.expert_bytes)} of experts per "
        f"layer per block ({format_bytes(copied * stage.expert_bytes)} of it loaded from "
        f"cpu/disk); grouped over {grouped}: {stage.tokens_per_expert:.1f} tokens per expert"
    )


def _moe_reasons(model: ModelSpec, result: PlanResult) -> list[str]:
    """Why the experts sit where they do: what a block touches and loads, and whether the CPU
    computes its experts (docs/policy.md, Mixture-of-experts)."""
    if not model.is_moe:
        return []
    policy, (prefill, decode) = result.policy, result.estimate.experts
    moe_layers = f"{model.num_moe_layers} of {model.num_layers} layers"
    stored = decode.expert_bytes / decode.distinct_experts
    size = format_bytes(model.expert_weight_bytes)
    if policy.compress_weights:
        size += f" ({format_bytes(stored)} at 4 bits)"
    lines = [
        f"  mixture of experts: {model.num_experts} routed experts in {moe_layers}, top-"
        f"{model.num_experts_per_tok}, {size} each; "
        f"{model.active_params / 1e9:.2f}B of {model.total_params / 1e9:.2f}B parameters "
        "active per token; uniform routing assumed",
        _stage_line(model, "decode step", decode, policy),
        _stage_line(model, "prefill", prefill, policy),
    ]
    break_even = result.expert_break_even
    if not break_even:
        why = "never: the CPU reads an expert's weights more slowly than PCIe copies them"
    else:
        why = f"{break_even} tokens (fewer run on the CPU, more are copied)"
    if policy.cpu_experts:
        where = ", ".join(
            f"{name} {'on the CPU' if stage.cpu_compute else 'copied'}"
            for name, stage in (("decode", decode), ("prefill", prefill))
        )
        chosen = f"chosen; CPU-homed experts: {where}"
    else:
        chosen = (
            f"not chosen ({decode.tokens_per_expert:.1f} tokens per expert in decode)"
            if break_even
            else "not chosen"
        )
    lines.append(f"  cpu expert compute: break-even {why}; {chosen}")
    return lines


def moe_summary(model: ModelSpec, result: PlanResult) -> dict[str, object]:
    """The MoE numbers of a plan, for `nanoflex plan --json` and bench/results."""
    policy, (prefill, decode) = result.policy, result.estimate.experts
    gpu, cpu, disk = experts_per_tier(model, policy)

    def stage(s: ExpertStage) -> dict[str, object]:
        return {
            "tokens_per_layer": s.num_tokens,
            "distinct_experts": s.distinct_experts,
            "expert_bytes_per_layer": s.expert_bytes,
            "tokens_per_expert": s.tokens_per_expert,
            "cpu_compute": s.cpu_compute,
        }

    # "expert_bytes": one expert as the plan stores and moves it (4-bit with compress_weights)
    return {
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.num_experts_per_tok,
        "num_moe_layers": model.num_moe_layers,
        "total_params": model.total_params,
        "active_params": model.active_params,
        "expert_bytes": decode.expert_bytes / decode.distinct_experts,
        "experts_per_layer": {"gpu": gpu, "cpu": cpu, "disk": disk},
        "cpu_experts": policy.cpu_experts,
        "cpu_expert_break_even_tokens": result.expert_break_even,
        "decode": stage(decode),
        "prefill": stage(prefill),
    }
