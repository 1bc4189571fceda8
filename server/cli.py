"""The `nanoflex` command line: one subcommand per handler module.

Each handler module exports `add_arguments(parser)` and `main(args) -> int`. Only the
module of the command being run is imported, so `nanoflex serve` never pulls torch into
the daemon process while `nanoflex bench` may import it at the top of its module.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from policy.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("server.serve", "run the OpenAI-compatible daemon"),
    "generate": ("engine.generate", "generate text for one prompt"),
    "run-batch": ("server.run_batch", "run an OpenAI Batch input file offline (resumable)"),
    "bench": ("engine.bench", "measure prefill/decode/generation throughput"),
    "plan": ("policy.plan", "choose a policy with the cost model"),
    "profile": ("engine.profile", "measure and cache this machine's hardware constants"),
}
"""Command -> (handler module, one-line help)."""


def handler(command: str) -> ModuleType:
    return importlib.import_module(COMMANDS[command][0])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that command's module is imported for its flags."""
    parser = argparse.ArgumentParser(
        prog="nanoflex", description="Throughput-oriented LLM serving on one GPU box."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or command == name:
            handler(name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    if args.command != "serve":  # uvicorn handles serve's; elsewhere `with` blocks clean up
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return int(handler(args.command).main(args))
    except UserError as e:
        print(f"nanoflex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nanoflex {args.command}: interrupted", file=sys.stderr)
        return 130


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
