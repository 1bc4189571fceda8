"""The `nanoflex` command line: one subcommand per handler module.

Each handler module exports `add_arguments(parser)` and `main(args) -> int`. Only the
module of the command being run is imported, so `nanoflex serve` never pulls torch into
the daemon process while `nanoflex bench` may import it at the top of its module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from base.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("server.http.serve", "run the OpenAI-compatible daemon"),
    "generate": ("engine.generate", "generate text for one prompt"),
    "run-batch": ("server.offline.run_batch", "run an OpenAI Batch input file offline (resumable)"),
    "bench": ("engine.throughput", "measure prefill/decode/generation throughput"),
    "plan": ("policy.plan", "choose a policy with the cost model"),
    "profile": ("engine.profiling.command", "measure and cache this machine's hardware constants"),
}
"""Command -> (handler module, one-line help)."""


def handler(command: str) -> ModuleType:
    return importlib.import_module(COMMANDS[command][0])


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help names its default: help text that does not already say it gets
    "(default: X)" appended (argparse's ArgumentDefaultsHelpFormatter, with on/off for
    switches and "none" for None, and "(required)" for required flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.required:
            return text if "required" in text else f"{text} (required)".strip()
        if not action.option_strings and action.nargs not in ("?", "*"):
            return text
        return f"{text} (default: {describe_default(action.default)})".strip()


def describe_default(value: object) -> str:
    """A default as help text shows it (escaped for argparse's %-formatting)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).replace("%", "%%")


def version() -> str:
    try:
        return importlib.metadata.version("nanoflex")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that command's module is imported for its flags."""
    parser = argparse.ArgumentParser(
        prog="nanoflex",
        description="Throughput-oriented LLM serving on one GPU box.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"nanoflex {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter
        )
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
