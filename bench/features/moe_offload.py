"""A mixture-of-experts model with most of its experts on disk, on the CPU: nanoflex against
transformers + Accelerate offloading on the same memory budget, and nanoflex's MoE ablations.

    python -m bench.features.moe_offload [--shape mixtral|deepseek-v3] [--prompts 16]
                                [--prompt-len 32] [--gen-len 32] [--repeat 1] [--json FILE]

The model: a `dummy:` checkpoint (generated weights, float32) of one of two shapes:
Mixtral's (6 layers, hidden 512, 32 experts of width 512 per layer, top-2, 657 MB, 92% of
it routed experts) or DeepSeek-V3's (6 layers, hidden 512, MLA, layer 0 dense, 64 routed
experts of width 256 in 8 groups, top-4 from 4 groups, one shared expert: `DEEPSEEK_V3`).
The budget: every tensor but the routed experts, and a third of the experts' bytes, in
memory; the other two thirds on disk. The same prompts (random token ids, one seed),
greedy, EOS ignored, every system in a child process of its own:

- nanoflex: `weights_frac` all in memory, `experts_frac` (1/3, 0, 2/3), the most-picked
  experts homed in memory (the counts from a first, unmeasured run of the same model on
  other prompts), four GPU batches of four sequences: each MoE layer groups the block's rows
  per expert and loads from disk only the experts the block routes to;
- its ablations, one switch off each: `--no-group-experts` (each GPU batch routes its own
  rows, every expert of the layer loaded with it), `--no-hot-experts` (experts homed in
  index order), and `cpu_experts` off against on with experts in the cpu tier (on a
  CPU-only box the cpu and gpu tiers are the same memory, so this one can only show that
  the switch costs nothing here; its gain is a GPU's);
- Accelerate: the first two of the six decoder layers and every other module in memory,
  the other four in its offload folder (its granularity is the layer; `dispatch_model`
  loads them per forward pass), the batch decoded by hand as bench/gpu/accelerate_run.py
  does. Its offload files are read through
  the page cache, which would hold them in memory after the first pass (nanoflex drops
  what it read): the page cache of its offload folder is dropped before each forward pass
  (`posix_fadvise`), so both read their disk-homed bytes from the disk every step.

Reported: generated tokens per second over the whole run (prefill and decode, after the
model is loaded), each against nanoflex's run of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.subproc import run_child

MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 8192,
    "num_local_experts": 32,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
"""DeepSeek-V3's structure at a CPU's scale: MLA (q through a 192-rank latent, the KV cache
one 128-wide latent plus 32 rotary dims), layer 0 dense, 64 routed experts in 8 groups (top-4
from the best 4 groups, sigmoid scores, scaled by 2.5) and one shared expert per MoE layer."""
SHAPES: dict[str, dict[str, Any]] = {"mixtral": MIXTRAL, "deepseek-v3": DEEPSEEK_V3}
EXPERTS_IN_MEMORY = 1 / 3
"""The share of the routed experts' bytes in memory; the rest on disk (for Accelerate, which
places whole layers: the first two of the six in memory)."""
VARIANTS: dict[str, dict[str, Any]] = {
    "nanoflex": {},
    "per-expert batching off": {"group_experts": False},
    "hot-expert placement off": {"hot_experts": False},
    "cpu experts on (experts in the cpu tier)": {"cpu_experts": True},
    "cpu experts off (experts in the cpu tier)": {"cpu_experts": False},
}


def model_dir(root: Path, config: dict[str, Any]) -> Path:
    out = root / "moe-offload-model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    vocab = int(SHAPES[args.shape]["vocab_size"])
    ids = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=generator)
    return [list(map(int, row)) for row in ids.tolist()]


def run_nanoflex(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from policy import Policy

    variant = dict(VARIANTS[args.variant]) if args.variant else {}
    cpu_experts = variant.pop("cpu_experts", None)
    experts_frac = (EXPERTS_IN_MEMORY, 0.0, 1 - EXPERTS_IN_MEMORY)
    if cpu_experts is not None:  # the memory share in the cpu tier, run there when few rows
        experts_frac = (0.0, EXPERTS_IN_MEMORY, 1 - EXPERTS_IN_MEMORY)
        variant["cpu_expert_rows"] = 4
    policy = Policy(
        weights_frac=(1.0, 0.0, 0.0),
        experts_frac=experts_frac,
        cpu_experts=bool(cpu_experts),
        gpu_batch_size=args.prompts // 4,
        num_gpu_batches=4,
    )
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="nanoflex-moe-") as offload:
        llm = LLM(
            f"dummy:{args.model_dir}", policy=policy, device="cpu", offload_dir=offload, **variant
        )
        with llm:
            llm.generate(prompts(args, seed=1)[:4], SamplingParams(max_tokens=2, ignore_eos=True))
            start = time.perf_counter()
            outputs = llm.generate(prompts(args, seed=args.seed), params)
            seconds = time.perf_counter() - start
            placed = llm.placement().weights_bytes
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tok_s": generated / seconds,
        "first_tokens": [o.outputs[0].token_ids[0] for o in outputs],
        "weights_bytes": placed,
    }


def run_accelerate(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from accelerate import dispatch_model

    from bench.gpu.accelerate_run import build_model

    hf_model, _ = build_model(str(args.model_dir), torch.float32)
    layers = int(SHAPES[args.shape]["num_hidden_layers"])
    resident = round(EXPERTS_IN_MEMORY * layers)  # whole layers: Accelerate's granularity
    device_map = {name: "cpu" for name, _ in hf_model.named_children() if name != "model"}
    device_map |= {f"model.{name}": "cpu" for name, _ in hf_model.model.named_children()}
    del device_map["model.layers"]
    device_map |= {f"model.layers.{i}": "cpu" if i < resident else "disk" for i in range(layers)}
    with tempfile.TemporaryDirectory(prefix="accelerate-moe-") as offload:
        hf_model = dispatch_model(
            hf_model, device_map=device_map, main_device="cpu", offload_dir=offload
        )
        total = sum(p.numel() * 4 for p in hf_model.parameters())
        on_disk = total * 0  # the disk layers' bytes, from the checkpoint's shapes
        for i in range(resident, layers):
            layer = hf_model.model.layers[i]
            on_disk += sum(p.numel() * 4 for p in layer.parameters())

        def drop_offload_cache(*_: Any) -> None:
            for path in Path(offload).rglob("*"):
                if path.is_file():
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)

        hf_model.register_forward_pre_hook(drop_offload_cache)
        ids = torch.tensor(prompts(args, seed=0))
        with torch.no_grad():
            hf_model(input_ids=ids[:4, :8], use_cache=True)  # warm-up
            start = time.perf_counter()
            out = hf_model(input_ids=ids, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1)
            first = token.tolist()
            for _ in range(args.gen_len - 1):
                out = hf_model(
                    input_ids=token[:, None], past_key_values=out.past_key_values, use_cache=True
                )
                token = out.logits[:, -1].argmax(-1)
            seconds = time.perf_counter() - start
    generated = args.prompts * args.gen_len
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tok_s": generated / seconds,
        "first_tokens": first,
        "weights_bytes": {"memory": total - on_disk, "disk": on_disk},
    }


def table_of(results: list[dict[str, Any]]) -> Table:
    """Each run against nanoflex's run of the same round."""
    table = Table(["round", "system", "generated tok/s", "vs nanoflex", "seconds"])
    for r in results:
        base = next(
            b["tok_s"] for b in results if b["system"] == "nanoflex" and b["repeat"] == r["repeat"]
        )
        ratio = f"{r['tok_s'] / base:.2f}x"
        row = [str(r["repeat"] + 1), r["system"], f"{r['tok_s']:.1f}", ratio, f"{r['seconds']:.1f}"]
        table.rows.append(row)
    return table


def child(args: argparse.Namespace) -> int:
    result = run_accelerate(args) if args.system == "accelerate" else run_nanoflex(args)
    Path(args.out).write_text(json.dumps(result) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    parser.add_argument("--json", default=None)
    parser.add_argument("--system", choices=("nanoflex", "accelerate"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.system is not None:
        return child(args)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moe-offload-") as tmp:
        root = Path(tmp)
        env = {"NANOFLEX_CACHE": str(root / "cache")}  # the picks of this sitting only
        common = ["-m", "bench.features.moe_offload", "--shape", args.shape]
        common += ["--model-dir", str(model_dir(root, SHAPES[args.shape]))]
        common += ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
        common += ["--gen-len", str(args.gen_len)]
        history = run_child(
            [
                *common,
                "--system",
                "nanoflex",
                "--variant",
                "nanoflex",
                "--seed",
                "7",
                "--out",
                str(root / "history.json"),
            ],
            timeout_s=1800,
            log_path=root / "history.log",
            env=env,
        )
        if history.returncode != 0:
            raise SystemExit(f"the history run failed:\n{history.output[-3000:]}")
        systems = [("nanoflex", v) for v in VARIANTS] + [("accelerate", "Accelerate")]
        for repeat in range(args.repeat):
            for system, variant in systems:
                out = root / f"{system}-{len(results)}.json"
                argv_ = [*common, "--system", system, "--out", str(out)]
                if system == "nanoflex":
                    argv_ += ["--variant", variant]
                done = run_child(
                    argv_, timeout_s=1800, log_path=root / f"{len(results)}.log", env=env
                )
                if done.returncode != 0:
                    raise SystemExit(f"{variant} failed:\n{done.output[-3000:]}")
                record = {"system": variant, "repeat": repeat, **json.loads(out.read_text())}
                print(json.dumps(record), file=sys.stderr)
                results.append(record)
    table = table_of(results)
    print(table.markdown("rlrrr"))
    config = {"shape": args.shape, "model": SHAPES[args.shape], "prompts": args.prompts}
    config |= {"prompt_len": args.prompt_len}
    config |= {"gen_len": args.gen_len, "experts_in_memory": EXPERTS_IN_MEMORY}
    write_json(args.json, [{"config": config, "runs": results}], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
