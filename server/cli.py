"""The `nanoflex` command line: parses arguments, then hands off to the owning package."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from policy.errors import UserError

# subcommand -> "module:function"; modules load only when their command runs,
# so `nanoflex serve` never pulls torch into the daemon process.
COMMANDS: dict[str, str] = {
    "serve": "server.serve:main",
    "generate": "engine.cli:generate_main",
    "run-batch": "server.run_batch:main",
    "bench": "engine.cli:bench_main",
    "plan": "policy.cli:plan_main",
    "profile": "engine.profiler:profile_main",
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local path or hub id (default: demo model)")
    p.add_argument("--policy", default=None, help="'auto' or a policy JSON file")
    p.add_argument("--offload-dir", default=None, help="directory for the disk tier")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--gpu-mem", default=None, help="GPU budget, e.g. 16GiB or bytes")
    p.add_argument("--cpu-mem", default=None, help="CPU memory budget, e.g. 64GiB")
    p.add_argument("--disk-mem", default=None, help="disk budget, e.g. 500GiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanoflex", description="Throughput-oriented LLM serving on one GPU box."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the OpenAI-compatible daemon")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", default="nanoflex-data", help="SQLite store, files, results")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429")
    p.add_argument("--in-process", action="store_true", help="run the engine in this process")

    p = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser("run-batch", help="run an OpenAI Batch input file offline (resumable)")
    _add_model_args(p)
    p.add_argument("-i", "--input", required=True, help="requests JSONL")
    p.add_argument("-o", "--output", required=True, help="results JSONL")
    p.add_argument("--error-file", default=None, help="errors JSONL (default: OUTPUT.errors)")

    p = sub.add_parser("bench", help="measure prefill/decode/generation throughput")
    _add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("plan", help="choose a policy with the cost model")
    p.add_argument("--model", default=None, help="path, hub id or known name (default: demo)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--gpu-mem", default=None)
    p.add_argument("--cpu-mem", default=None)
    p.add_argument("--disk-mem", default=None)
    p.add_argument("--hardware", default=None, help="hardware JSON (default: cached profile)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("profile", help="measure and cache this machine's hardware constants")
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--json", action="store_true")
    return parser


def resolve(command: str) -> Callable[[argparse.Namespace], int]:
    module_name, func_name = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return resolve(args.command)(args)
    except UserError as e:
        print(f"nanoflex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nanoflex {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
