"""The incremental detokenizer (`engine/core/detokenizer.py`) against decoding the whole output.

Each sequence's text is handed out piece by piece, each piece decoded from the last few
tokens only; joined, the pieces must equal the tokenizer's decode of the whole output (for
every stop reason), and at every step be a prefix of it (a character split over tokens waits
for its last byte, a possible stop string for the token that rules it out): nothing handed
out is taken back, which is what lets streaming send each piece as it comes. Tokens are
drawn to stress the hard cases: pieces of multi-byte characters, leading spaces, special
tokens, and stop strings that span tokens. Each test runs on the four ways a sequence is
decoded: the served tokenizer's stepper (SmolLM2's vocabulary is byte-level: its byte table),
tokenizers' `DecodeStream` (the stepper of any other tokenizer), the detokenizer's own window
(a decoder without a stepper), and a stepper that fails part-way (the rest decoded whole).
"""

from __future__ import annotations

import functools
import itertools
import random
from pathlib import Path

import pytest

from engine.core.detokenizer import IncrementalDetokenizer, Stepper
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Request, Sequence
from engine.core.tokenizer import Tokenizer, byte_level_table

EOS = 2
MAX_LEN = 10_000


class DecodeStreamTokenizer(Tokenizer):
    """The served tokenizer as one that is not byte-level: tokenizers' `DecodeStream` steps."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        self._byte_table = None


class WindowTokenizer(Tokenizer):
    """The served tokenizer without a stepper: the detokenizer decodes its own windows."""

    stepper = None  # type: ignore[assignment]


class FailingStepperTokenizer(Tokenizer):
    """A stepper that fails at its fourth token, as tokenizers' does on a prefix it cannot
    extend."""

    def stepper(self, skip_special_tokens: bool = True) -> Stepper:
        step, count = super().stepper(skip_special_tokens), itertools.count()

        def failing(token_id: int) -> str | None:
            if next(count) == 3:
                raise RuntimeError("Invalid prefix encountered")
            return step(token_id)

        return failing


@pytest.fixture(
    scope="module",
    params=[Tokenizer, DecodeStreamTokenizer, WindowTokenizer, FailingStepperTokenizer],
    ids=["byte-table", "decode-stream", "window", "stepper-fails"],
)
def tokenizer(smollm2_dir: Path, request: pytest.FixtureRequest) -> Tokenizer:
    cls: type[Tokenizer] = request.param
    return cls(smollm2_dir)


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
    """The sequence after `out`, and its text after each token (the pieces joined)."""
    params = SamplingParams(ignore_eos=True, max_tokens=len(out), **sampling)  # type: ignore[arg-type]
    request = Request("r", prompt, params)
    seq = Sequence.from_request(request, 0, tokenizer)
    texts, text = [], ""
    for token in out:
        text += seq.append_token(token, None, (EOS,), MAX_LEN).new_text
        texts.append(text)
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
    assert texts[-1] == tokenizer.decode(out)
    for i, text in enumerate(texts):
        assert tokenizer.decode(out[: i + 1]).startswith(text), i


def test_stop_strings_across_tokens_cut_as_on_the_whole_text(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(20):
        out = outputs(tokenizer, rng, 40)
        full = tokenizer.decode(out)
        start = rng.randrange(len(full) - 6)
        stop = full[start : start + rng.randrange(2, 6)]
        seq, texts = run(tokenizer, [1], out, stop=[stop, "never-there"])
        assert seq.finish_reason == "stop" and seq.stop_reason == stop
        assert texts[-1] == full[: full.find(stop)]
        for i, text in enumerate(texts):  # no piece of the stop string is ever handed out
            assert full[: full.find(stop)].startswith(text), i


def test_a_stop_token_ends_the_text_before_its_own(tokenizer: Tokenizer) -> None:
    out = tokenizer.encode("naïve 日本語 text")
    seq, texts = run(tokenizer, [1], [*out, 999, 5], stop_token_ids=[999])
    assert seq.finish_reason == "stop" and seq.stop_reason == 999
    assert texts[-1] == tokenizer.decode(out)


def test_text_held_back_for_a_stop_string_comes_out_at_the_end(tokenizer: Tokenizer) -> None:
    """A tail that starts like a stop string but never completes it is handed out when the
    sequence ends (length, a stop token, an abort), never lost."""
    out = tokenizer.encode("the end is near")
    for stop_token in (False, True):
        tokens = [*out, 999] if stop_token else out
        seq, texts = run(tokenizer, [1], tokens, stop=["near and far"], stop_token_ids=[999])
        assert texts[-1] == "the end is near" and seq.stop_reason == (999 if stop_token else None)
        assert texts[-2] != texts[-1]  # the last characters waited: they may start the stop
    seq = Sequence.from_request(Request("r", [1], SamplingParams(stop=["near!"])), 0, tokenizer)
    pieces = [seq.append_token(t, None, (EOS,), MAX_LEN).new_text for t in out]
    assert "".join(pieces) + seq.abort().new_text == "the end is near"


def test_special_tokens_are_kept_when_asked(tokenizer: Tokenizer) -> None:
    """skip_special_tokens=False (gpt-oss's harmony markers are read from them): the pieces
    joined are the tokenizer's decode keeping special tokens; by default they are left out."""
    ids = tokenizer.encode("<|im_start|>assistant\nthé 🙂<|im_end|>\n", add_special_tokens=False)
    assert tokenizer.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False)
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        pieces = [detokenizer.add_token(t) for t in ids] + [detokenizer.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_pieces_of_one_character_wait_for_its_last_byte(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the emoji should take several byte tokens"
    pieces = [detokenizer.add([t], final=False) for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂"
    cut = IncrementalDetokenizer(tokenizer)
    assert cut.add(ids[:1], final=False) == "" and cut.flush() == tokenizer.decode(ids[:1])


@pytest.mark.parametrize(
    "sampling",
    [
        {},  # length
        {"ignore_eos": False},  # EOS: its text is not output
        {"stop_token_ids": [999]},
        {"stop": ["ö", "語 🙂"]},  # stop strings: decoded per token, handed out at the end
        {"logprobs": 0},
    ],
    ids=["length", "eos", "stop-token", "stop-strings", "logprobs"],
)
def test_a_final_only_request_hands_out_its_whole_choice_once(
    tokenizer: Tokenizer, sampling: dict[str, object]
) -> None:
    """A final-only request (an answer that does not stream) gets no delta until its choice
    ends, then one with all its tokens, its text (decoded once at the end when it has no stop
    strings) and logprobs: the same as the joined deltas of the request streamed."""
    rng = random.Random(7)
    for _ in range(8):
        out = outputs(tokenizer, rng, 12)
        if sampling.get("ignore_eos") is False:
            out.insert(rng.randrange(1, len(out)), EOS)
        if "stop_token_ids" in sampling:
            out.insert(rng.randrange(1, len(out)), 999)
        params = SamplingParams(**{"ignore_eos": True, "max_tokens": len(out), **sampling})  # type: ignore[arg-type]
        ends = []
        for final_only in (False, True):
            seq = Sequence.from_request(
                Request("r", [1], params, final_only=final_only), 0, tokenizer
            )
            deltas = []
            for token in out:
                delta = seq.append_token(token, {token: -0.5}, (EOS,), MAX_LEN)  # type: ignore[arg-type]
                if delta is not None:
                    deltas.append(delta)
                if seq.is_finished:
                    break
            ends.append(
                (
                    [t for d in deltas for t in d.new_token_ids],
                    "".join(d.new_text for d in deltas),
                    [lp for d in deltas for lp in d.new_logprobs or []],
                    deltas[-1].finish_reason,
                    deltas[-1].stop_reason,
                )
            )
            if final_only:
                assert len(deltas) == 1 and deltas[0].first_token_time is not None
            else:
                assert len(deltas) == len(ends[0][0])
        assert ends[0] == ends[1]


def test_the_served_tokenizer_steps_by_its_byte_table(smollm2_dir: Path) -> None:
    """SmolLM2's decoder is byte-level alone: its stepper reads the table (so the
    "byte-table" runs above test it), which holds every token, the special ones empty."""
    tokenizer = Tokenizer(smollm2_dir)
    table = byte_level_table(tokenizer._tokenizer)
    assert table is not None
    texts, partial = table
    assert len(texts) == tokenizer.vocab_size and 0 < len(partial) < len(texts) // 10
    assert texts[EOS] == "" and partial.keys() == {i for i, t in enumerate(texts) if t is None}
    step = tokenizer.stepper()
    assert not isinstance(step, functools.partial)  # not DecodeStream's
    assert step(tokenizer.encode("hello", False)[0]) == "hello"


def test_byte_table_steps_decode_as_the_tokenizer_does(smollm2_dir: Path) -> None:
    """Outputs drawn mostly from tokens that are pieces of characters (and ids past the
    vocabulary, which the tokenizer skips): the table's pieces, joined, are at each step a
    prefix of the tokenizer's decode of the whole output, and at the end equal to it."""
    tokenizer = Tokenizer(smollm2_dir)
    table = byte_level_table(tokenizer._tokenizer)
    assert table is not None
    pieces = sorted(table[1])
    rng = random.Random(0)
    for _ in range(400):
        draw = [
            rng.choice(pieces) if rng.random() < 0.6 else rng.randrange(49160) for _ in range(20)
        ]
        whole = tokenizer.decode(draw)
        detokenizer = IncrementalDetokenizer(tokenizer)
        text = ""
        for token_id in draw:
            text += detokenizer.add_token(token_id)
            assert whole.startswith(text), (draw, text, whole)
        assert text + detokenizer.flush() == whole, draw


def test_a_tokenizer_that_is_not_byte_level_has_no_table(tmp_path: Path) -> None:
    """A SentencePiece-style decoder (Metaspace) decodes with `DecodeStream`; so does a
    byte-level one whose table would not decode a token as the tokenizer does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2}
    sentencepiece = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sentencepiece.decoder = decoders.Metaspace()
    assert byte_level_table(sentencepiece) is None
    sentencepiece.save(str(tmp_path / "tokenizer.json"))
    step = Tokenizer(tmp_path).stepper()
    assert isinstance(step, functools.partial)  # DecodeStream's
    assert step(1) == "hello" and step(2) == " world"

    byte_level = HFTokenizer(models.WordLevel({"\u0100": 0, "a": 1}, unk_token="a"))
    byte_level.decoder = decoders.ByteLevel()
    assert byte_level_table(byte_level) is not None
    with pytest.MonkeyPatch.context() as patch:  # a wrong alphabet: the check refuses it
        patch.setattr(
            "engine.core.tokenizer._byte_chars", lambda: [chr(0x200 + b) for b in range(256)]
        )
        assert byte_level_table(byte_level) is None
