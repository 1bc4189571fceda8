"""Where a resident step's time goes on the GPU: the device busy or waiting on the host, and
which kernels take the busy time.

    python -m bench.gpu.breakdown [--model llama-3-8b] [--prompts 256] [--prompt-len 512]
        [--gen-len 16] [--policy auto|JSON] [--device cuda] [--json gpu-breakdown.json]

The H200 ran Llama-3-8B 512+32 resident at 25% of gpu_flops / (2 x params): prefill 163 ms a
step of ~2,000 tokens, where the GEMMs alone need ~45 ms. A throughput figure cannot say why;
this names it. The model's shape with generated weights (`dummy:`), `--policy auto` on the
whole card, one warm-up, then two phases, each a `generate` under torch's profiler:

- **prefill**: `--prompts` prompts of `--prompt-len` tokens, one token each;
- **decode**: as many prompts of 16 tokens, `--gen-len` tokens each (decode steps dominate).

Per phase: the wall time and steps; the device's busy time (the sum of its kernels' times,
over 100% of the wall where streams overlap; on the CPU, the operators' own times) and its
share of the wall, so that a host-bound step shows
as a low share; the busiest kernels by total time, with calls and share. On the CPU (the GPU
pass's dry run) the same runs small, with the CPU's operators in place of kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.common import Table, write_json

TOP_KERNELS = 12
CPU_OPERATORS = ("aten::", "nanoflex::", "mkldnn::")
"""On the CPU, the operators whose own time is the device's (the rest is Python around them)."""


def phase(llm: Any, name: str, prompts: list[list[int]], max_tokens: int, cuda: bool) -> dict:
    """One profiled `generate`: wall, steps, busy time, the top kernels."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    core, steps = llm.step_loop, [0]
    step = core.step

    def counted() -> Any:
        steps[0] += 1
        return step()

    core.step = counted  # the engine's steps, counted for this phase
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        del core.step
    kernels: list[tuple[str, int, float]] = []
    for event in prof.key_averages():
        if cuda:  # the kernels themselves (an operator's row repeats its kernels' time)
            own = event.self_device_time_total if event.device_type == DeviceType.CUDA else 0.0
        else:
            own = float(event.self_cpu_time_total) if event.key.startswith(CPU_OPERATORS) else 0.0
        if own <= 0:
            continue
        kernels.append((event.key, event.count, own / 1e6))
    kernels.sort(key=lambda k: -k[2])
    busy = sum(seconds for _, _, seconds in kernels)
    tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "phase": name,
        "wall_seconds": wall,
        "tokens": tokens,
        "steps": steps[0],
        "busy_seconds": busy,
        "busy_share": busy / wall,
        "top": [
            {"name": n[:120], "calls": c, "seconds": s, "share_of_wall": s / wall}
            for n, c, s in kernels[:TOP_KERNELS]
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM
    from engine.loading.generated import local_model_dir
    from policy import Policy

    cuda = args.device == "cuda"
    policy = "auto" if args.policy == "auto" else Policy.from_json(args.policy)
    llm = LLM(str(local_model_dir(f"dummy:{args.model}")), policy=policy, device=args.device)
    try:
        vocab = llm.executor.config.vocab_size
        g = torch.Generator().manual_seed(0)

        def prompts(length: int) -> list[list[int]]:
            return [
                torch.randint(3, vocab, (length,), generator=g).tolist()
                for _ in range(args.prompts)
            ]

        phase(llm, "warm-up", prompts(16)[: max(1, args.prompts // 8)], 2, cuda)
        phases = [
            phase(llm, "prefill", prompts(args.prompt_len), 1, cuda),
            phase(llm, "decode", prompts(16), args.gen_len, cuda),
        ]
        return {
            "model": args.model,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "policy": llm.policy.to_dict(),
            "dtype": str(llm.executor.dtype).removeprefix("torch."),
            "phases": phases,
        }
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="llama-3-8b", help="a built-in shape (dummy weights)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--policy", default="auto", help="auto (searched), or a Policy's JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    table = Table(["phase", "wall", "steps", "tok/s", "device busy", "top kernel"])
    for p in result["phases"]:
        top: dict[str, Any] = p["top"][0] if p["top"] else {"name": "-", "share_of_wall": 0.0}
        table.rows.append(
            [
                p["phase"],
                f"{p['wall_seconds']:.2f} s",
                str(p["steps"]),
                f"{p['tokens'] / p['wall_seconds']:.0f}",
                f"{100 * p['busy_share']:.0f}%",
                f"{top['name'][:48]} ({100 * top['share_of_wall']:.0f}%)",
            ]
        )
        for k in p["top"]:
            share = f"{100 * k['share_of_wall']:5.1f}%"
            print(f"{p['phase']:8s} {share} {k['calls']:7d}  {k['name'][:100]}", file=sys.stderr)
    print(table.markdown("lrrrrl"))
    write_json(args.json, [result], table, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
