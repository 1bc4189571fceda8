"""The child process of a plan check (engine/core/plan_check.py): each candidate policy runs
one block of the model for real.

    python -m engine.plan_check_run SPEC.json OUT.json

For each candidate: the engine built with that policy, one warm-up request, then one block
of `block_size` prompts of `check_prompt_len` tokens (the planned length, or shorter where
that block's prefill would take long: plan_check.CHECK_PREFILL_SECONDS), `check_steps`
tokens each, EOS ignored (`engine.throughput.run_bench`). The generation throughput for the
planned workload is worked out from the measured prefill, scaled to the planned prompt
length, and the mean decode step: block x gen_len / (prefill + (gen_len - 1) x step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def run_candidate(setup: dict[str, Any], policy_dict: dict[str, Any]) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.throughput import run_bench
    from policy import Policy
    from policy.specs import WorkloadSpec

    policy = Policy.from_dict(policy_dict)
    prompt_len, gen_len, steps = setup["prompt_len"], setup["gen_len"], setup["check_steps"]
    checked_len = setup.get("check_prompt_len", prompt_len)
    with LLM(
        setup["model_dir"],
        policy=policy,
        device=setup["device"],
        dtype=setup["dtype"],
        gpu_mem=setup["gpu_mem"],
        cpu_mem=setup["cpu_mem"],
        disk_mem=setup["disk_mem"],
        workload=WorkloadSpec(prompt_len, gen_len),
    ) as llm:
        llm.generate([[5] * 8], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        measured = run_bench(llm, checked_len, steps + 1, policy.block_size, progress=False)
    step = measured["decode_seconds"] / steps
    prefill = measured["prefill_seconds"] * prompt_len / checked_len
    seconds = prefill + step * (gen_len - 1)
    return {
        "policy": policy.to_dict(),
        "prompt_len": checked_len,
        "prefill_seconds": measured["prefill_seconds"],
        "decode_step_seconds": step,
        "generation_throughput": policy.block_size * gen_len / seconds,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    runs = []
    for candidate in spec["candidates"]:
        run = run_candidate(spec, candidate["policy"])
        runs.append({**run, "predicted": candidate["predicted"]})
        print(
            f"plan check: {run['generation_throughput']:.1f} tok/s measured, "
            f"{candidate['predicted']:.1f} predicted: {json.dumps(candidate['policy'])}",
            file=sys.stderr,
        )
    Path(argv[2]).write_text(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
