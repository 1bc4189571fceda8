"""The incremental detokenizer (`Sequence._detokenize`) against decoding the whole output.

Each sequence's text is built token by token from the last few tokens only; it must end
equal to the tokenizer's decode of the whole output (for every stop reason), and at every
step be a prefix of it (a character split over tokens waits for its last byte). Tokens are
drawn to stress the hard cases: pieces of multi-byte characters, leading spaces, special
tokens, and stop strings that span tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Request, Sequence
from engine.core.tokenizer import Tokenizer

EOS = 2
MAX_LEN = 10_000


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def outputs(tokenizer: Tokenizer, rng: random.Random, length: int) -> list[int]:
    """Token ids drawn from text with multi-byte characters and spaces, broken up by
    arbitrary ids (bytes that open characters never closed, special tokens)."""
    text = "".join(
        rng.choice(["héllo", " wörld", "日本語", "🙂", " ", "\n", "naïve", "Ωmega", "x"])
        for _ in range(length)
    )
    ids = tokenizer.encode(text)
    vocab = tokenizer.vocab_size
    for _ in range(len(ids) // 8):
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(vocab))
    return ids


def run(
    tokenizer: Tokenizer, prompt: list[int], out: list[int], **sampling: object
) -> tuple[Sequence, list[str]]:
    params = SamplingParams(ignore_eos=True, max_tokens=len(out), **sampling)  # type: ignore[arg-type]
    request = Request("r", prompt, params)
    seq = Sequence.expand(request, 0)[0]
    texts = []
    for token in out:
        seq.append_token(token, None, (EOS,), MAX_LEN, tokenizer)
        texts.append(seq.text)
        if seq.is_finished:
            break
    return seq, texts


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_decoding_the_whole_output(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    prompt = outputs(tokenizer, rng, 5)
    out = outputs(tokenizer, rng, 60)
    seq, texts = run(tokenizer, prompt, out)
    assert seq.finish_reason == "length"
    assert seq.text == tokenizer.decode(out)
    for i, text in enumerate(texts):
        assert tokenizer.decode(out[: i + 1]).startswith(text), i


def test_stop_strings_across_tokens_cut_as_on_the_whole_text(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(20):
        out = outputs(tokenizer, rng, 40)
        full = tokenizer.decode(out)
        start = rng.randrange(len(full) - 6)
        stop = full[start : start + rng.randrange(2, 6)]
        seq, _ = run(tokenizer, [1], out, stop=[stop, "never-there"])
        assert seq.finish_reason == "stop" and seq.stop_reason == stop
        assert seq.text == full[: full.find(stop)]


def test_a_stop_token_ends_the_text_before_its_own(tokenizer: Tokenizer) -> None:
    out = tokenizer.encode("naïve 日本語 text")
    seq, _ = run(tokenizer, [1], [*out, 999, 5], stop_token_ids=[999])
    assert seq.finish_reason == "stop" and seq.stop_reason == 999
    assert seq.text == tokenizer.decode(out)
