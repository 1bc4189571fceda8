"""`nanoflex generate`: one prompt through the offline engine, printed with its completion."""

from __future__ import annotations

import argparse

from engine.core.engine_args import EngineArgs
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def main(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    with LLM.from_engine_args(EngineArgs.from_cli_args(args, show_progress=True)) as llm:
        output = llm.generate([args.prompt], params)[0]
    print(args.prompt + output.outputs[0].text)
    return 0
