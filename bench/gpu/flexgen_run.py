"""FlexGen 0.1.8 as a baseline: run `flexgen.flex_opt` offline under a GPU cap, parse its log.

Child entry point (what `bench.gpu.compare` starts, under a hard timeout):

    python -m bench.gpu.flexgen_run [--gpu-mem BYTES] [--json OUT] -- <flex_opt arguments>

It does what `python -m flexgen.flex_opt ...` does (argument parsing, then
`run_flexgen`) with two changes: the GPU memory cap, which FlexGen lacks, is applied
with `torch.cuda.set_per_process_memory_fraction` before anything is allocated; and
the `facebook/opt-30b` tokenizer FlexGen always fetches from the hub is replaced by a
locally built one (with `--path _DUMMY_` it only encodes a fixed prompt, padded to
the prompt length, so any tokenizer with OPT's pad id does).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import traceback
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

OPT_VOCAB_SIZE = 50272
OPT_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3: OPT's pad is 1, bos/eos 2

_NUMBER = r"([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|inf|nan)"
_FIELDS = {
    "prefill_seconds": rf"prefill latency: {_NUMBER} s",
    "prefill_throughput": rf"prefill throughput: {_NUMBER} token/s",
    "decode_seconds": rf"decode latency: {_NUMBER} s",
    "decode_throughput": rf"decode throughput: {_NUMBER} token/s",
    "total_seconds": rf"total latency: {_NUMBER} s",
    "generation_throughput": rf"total throughput: {_NUMBER} token/s",
    "model_gb": rf"model size: {_NUMBER} GB",
    "cache_gb": rf"cache size: {_NUMBER} GB",
    "peak_gpu_gb": rf"peak gpu mem: {_NUMBER} GB",
}


class FlexGenOutputError(ValueError):
    """FlexGen's output lacks the benchmark log (it failed, or its format changed)."""


def parse_flexgen_output(text: str) -> dict[str, Any]:
    """FlexGen's `write_benchmark_log` lines -> our metric names (docs/benchmarks.md, Metrics:
    FlexGen's own definitions). The last occurrence wins; 'projected' says whether FlexGen
    extrapolated."""
    out: dict[str, Any] = {}
    for key, pattern in _FIELDS.items():
        matches = re.findall(pattern, text)
        if matches:
            out[key] = float(matches[-1])
    if "generation_throughput" not in out:
        raise FlexGenOutputError("no 'total throughput: X token/s' line in FlexGen's output")
    projected = re.findall(r"projected: (True|False)", text)
    out["projected"] = bool(projected) and projected[-1] == "True"
    return out


def build_tokenizer() -> Any:
    """A word-level tokenizer over OPT's vocabulary size, with OPT's special-token ids, that
    pads on the left as FlexGen asks; it never touches the network."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(OPT_SPECIALS)}
    for word in ("Paris", "is", "the", "capital", "city", "of"):  # FlexGen's prompt
        vocab.setdefault(word, len(vocab))
    vocab.update({f"<{i}>": i for i in range(len(vocab), OPT_VOCAB_SIZE)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
    )


def patch_tokenizer(flex_opt: Any) -> None:
    """Make `flex_opt.AutoTokenizer.from_pretrained(...)` return the local tokenizer."""
    tokenizer = build_tokenizer()

    class LocalTokenizer:
        @staticmethod
        def from_pretrained(name: str, **kwargs: Any) -> Any:
            tokenizer.padding_side = kwargs.get("padding_side", "left")
            return tokenizer

    flex_opt.AutoTokenizer = LocalTokenizer


def cap_gpu_memory(gpu_mem: int | None) -> None:
    if gpu_mem is None:
        return
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_mem / total), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpu-mem", type=int, default=None, help="GPU cap in bytes")
    parser.add_argument("--json", default=None, help="write the parsed metrics here")
    parser.add_argument("flexgen_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flexgen_argv = [a for a in args.flexgen_args if a != "--"]
    cap_gpu_memory(args.gpu_mem)
    from flexgen import flex_opt

    patch_tokenizer(flex_opt)
    flex_parser = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(flex_parser)
    flex_args = flex_parser.parse_args(flexgen_argv)
    if len(flex_args.percent) != 6:
        raise SystemExit("--percent takes six numbers")
    captured = io.StringIO()
    record: dict[str, Any] = {"ok": False, "argv": flexgen_argv}
    try:
        with redirect_stdout(_Tee(sys.stdout, captured)):
            flex_opt.run_flexgen(flex_args)
        record.update(ok=True, metrics=parse_flexgen_output(captured.getvalue()))
    except Exception as e:  # FlexGen fails in many ways (OOM, asserts); report them all
        traceback.print_exc()
        record["error"] = f"{type(e).__name__}: {e}"
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if record["ok"] else 1)  # FlexGen's copy threads may never join: do not wait


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()


if __name__ == "__main__":
    sys.exit(main())
