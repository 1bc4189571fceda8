"""`nanoflex generate`: one prompt through the offline engine, printed with its completion.

With `--chat` the prompt is sent as one user message rendered with the model's chat template
(what /v1/chat/completions does) and only the answer is printed. An instruct model given
plain text often ends at once; then the command says that `--chat` is what it wants.
"""

from __future__ import annotations

import argparse
import sys

from engine.core.engine_args import EngineArgs
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM

STOPPED_AT_ONCE_TOKENS = 1
"""An answer of at most this many tokens that ended on a stop id "ended at once"."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text (required)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message with the model's chat template and print only "
        "the answer (default: off, the prompt is plain text continued by the model)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")


def main(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    with LLM.from_engine_args(EngineArgs.from_cli_args(args, show_progress=True)) as llm:
        tokenizer = llm.tokenizer
        if args.chat:
            if tokenizer is None or tokenizer.chat_template is None:
                from base.errors import UserError

                raise UserError(f"{llm.executor.model_dir} has no chat template; drop --chat")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            output = llm.generate([ids], params)[0].outputs[0]
            print(output.text)
            return 0
        output = llm.generate([args.prompt], params)[0].outputs[0]
    print(args.prompt + output.text)
    ended_at_once = (
        output.finish_reason == "stop" and len(output.token_ids) <= STOPPED_AT_ONCE_TOKENS
    )
    if ended_at_once and tokenizer is not None and tokenizer.chat_template is not None:
        print(
            "nanoflex generate: the model ended at once: it is a chat model (it has a chat "
            "template); pass --chat to send the prompt as a chat message",
            file=sys.stderr,
        )
    return 0
