"""`IncrementalDetokenizer`: a sequence's generated tokens as text, a piece per token (torch-free).

vLLM's and TGI's method: each new token decodes a window of the last few tokens from a
prefix offset, with and without the new ones, and keeps the difference, so a token costs
the same at the thousandth as at the first, and a tokenizer that reads a token by its
neighbours (a leading space, the bytes of one character) sees the same ones as a decode of
the whole output. Text that ends inside a multi-byte character waits for its last byte.
A decoder that offers a `stepper` (the served tokenizer: its byte-level vocabulary's table,
`byte_level_stepper`, or else tokenizers' `DecodeStream`, the window's method in Rust)
decodes with it; after a stepper fails (tokenizers refuses a prefix it cannot extend), that
output is decoded whole at each call from then on, exact but O(n) a token. A decoder without
a stepper uses the window.

Stop strings are searched only where a new one can end, and the last `longest stop - 1`
characters are held back until the next token shows they do not start one: so the pieces
handed out, joined, are exactly the whole output's text cut before the first stop string,
and nothing handed out is ever taken back (what streaming needs).
"""

from __future__ import annotations

import functools
from codecs import utf_8_decode
from collections.abc import Callable
from typing import Any, Protocol

Stepper = Callable[[int], "str | None"]
"""One output's incremental decode: a token's text once it is whole (None while a character
is cut short), joined equal to a prefix of decoding all the tokens given so far."""


def byte_level_stepper(texts: list[str | None], partial: dict[int, bytes]) -> Stepper:
    """A stepper for a byte-level vocabulary (GPT-2's, Llama 3's, Qwen's: a token is bytes,
    the text is their UTF-8), read from its table: `texts[id]` is a token's text when its
    bytes are whole characters ("" for a special token, which is skipped), None when they
    are not; `partial[id]` the bytes of those. A token after whole characters is a look-up;
    bytes that end inside a character wait, as tokenizers' `DecodeStream` waits, and invalid
    ones decode to U+FFFD as a whole decode has them. An id past the table raises (the
    detokenizer then decodes whole)."""
    pending = b""

    def step(token_id: int) -> str | None:
        nonlocal pending
        if not pending:
            text = texts[token_id]
            if text is not None:
                return text
            data = partial[token_id]
        else:
            piece = partial.get(token_id)
            data = pending + ((texts[token_id] or "").encode() if piece is None else piece)
        text, used = utf_8_decode(data, "replace", False)
        if used < len(data):  # it ends inside a character: nothing until that is whole
            pending = data
            return None
        pending = b""
        return text

    return step


class Detokenizer(Protocol):
    """Turns generated token ids into text (the served tokenizer, skipping special tokens).
    It may also have `stepper() -> Stepper`: a new incremental decode of one output."""

    def decode(self, token_ids: list[int]) -> str: ...


class SpecialsKept:
    """A served tokenizer's decode that keeps special tokens' text (a request's
    `skip_special_tokens=False`): its `decode` and `stepper` asked to keep them."""

    def __init__(self, decoder: Detokenizer) -> None:
        self._decoder: Any = decoder  # the served tokenizer: decode and stepper take the flag
        stepper = getattr(decoder, "stepper", None)
        self.stepper: Callable[[], Stepper] | None = None
        if stepper is not None:
            self.stepper = functools.partial(stepper, skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._decoder.decode(token_ids, skip_special_tokens=False))


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, handed out piece by piece."""

    def __init__(
        self, decoder: Detokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True
    ) -> None:
        self.decoder = decoder if skip_special_tokens else SpecialsKept(decoder)
        self.stop = stop
        """Stop strings: the text ends before the first one."""
        self.stop_hit: str | None = None
        """The stop string that ended the text, once one has."""
        self._hold = max(map(len, stop), default=1) - 1
        """Characters kept back: the longest tail that may be the start of a stop string."""
        self._window: list[int] = []
        """Output tokens from the prefix offset on: the first `_num_read` are decoded, the
        others wait (for the next token, or for the rest of a character)."""
        self._num_read = 0
        self._held = ""
        """Decoded text not handed out yet (at most `_hold` characters)."""
        new_stepper: Callable[[], Stepper] | None = getattr(self.decoder, "stepper", None)
        self._step = new_stepper() if new_stepper is not None else None
        """The decoder's stepper, while there is one that has not failed."""
        self._steps = self._step is not None
        """This output is decoded by the stepper (or, once it failed, whole each time)."""
        self._tokens: list[int] = []
        """With a stepper: every token read, and `_num_chars` the characters handed out for
        them."""
        self._num_chars = 0
        self._cut = False
        """With a stepper: the last token read is part of a character not whole yet."""

    def add(self, token_ids: list[int], final: bool, find_stop: bool = True) -> str:
        """Take new tokens; the text that is now certain. `final`: no token follows, so
        everything decoded is handed out (a character cut short decodes as U+FFFD).
        `find_stop` False: stop strings do not end the text yet (min_tokens); what is held
        back is searched with the next tokens'."""
        if self.stop_hit is not None:
            return ""
        if self._steps:
            text = self._step_through(token_ids, final)
        else:
            self._window += token_ids
            text = self._decode(final)
        if not self.stop:  # nothing held back
            return text
        text = self._held + text
        hit = self._find_stop(text) if find_stop else None
        if hit is not None:
            position, self.stop_hit = hit
            self._held = ""
            return text[:position]
        keep = 0 if final else min(self._hold, len(text))
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def add_token(self, token_id: int) -> str:
        """`add([token_id], final=False)`: a decode's usual step (one token, more to come),
        straight to the stepper when nothing is held back for stop strings."""
        if self.stop or not self._steps:
            return self.add([token_id], False)
        return self._step_one(token_id)

    def flush(self) -> str:
        """Everything not handed out yet (the sequence ended for another reason)."""
        return self.add([], final=True)

    def _step_through(self, token_ids: list[int], final: bool) -> str:
        """The text `token_ids` add, by the stepper; `final`: a character cut short at the
        end is decoded as the whole output's decode has it (U+FFFD)."""
        if final and not self._tokens:  # a whole output at once (final-only): one decode
            self._tokens += token_ids
            text = self.decoder.decode(token_ids)
            self._num_chars += len(text)
            return text
        text = "".join([self._step_one(token_id) for token_id in token_ids])
        if final and self._step is None:
            text += self._decode_whole(True)
        elif final and self._cut:
            rest = self.decoder.decode(self._tokens)[self._num_chars :]
            self._num_chars += len(rest)
            text += rest
        return text

    def _step_one(self, token_id: int) -> str:
        """The text one more token adds, by the stepper. After the stepper failed (tokenizers
        refuses a prefix it cannot extend), every token read is decoded whole at each token:
        exact, for the rest of this output."""
        self._tokens.append(token_id)
        step = self._step
        if step is not None:
            try:
                piece = step(token_id)
            except Exception:
                self._step = None
            else:
                self._cut = piece is None
                if not piece:
                    return ""
                self._num_chars += len(piece)
                return piece
        return self._decode_whole(False)

    def _decode_whole(self, final: bool) -> str:
        """After the stepper failed: the text of every token read past what was handed out
        (nothing while it ends in a cut character and more tokens come)."""
        text = self.decoder.decode(self._tokens)[self._num_chars :]
        if text.endswith("\ufffd") and not final:
            return ""  # nothing whole yet
        self._num_chars += len(text)
        return text

    def _decode(self, final: bool) -> str:
        """The text the unread tokens of the window add to what is decoded."""
        if len(self._window) <= self._num_read:
            return ""
        seen = self.decoder.decode(self._window[: self._num_read])
        text = self.decoder.decode(self._window)
        if len(text) <= len(seen) or (text.endswith("\ufffd") and not final):
            return ""  # nothing whole yet
        # the next window starts at the tokens read before these: their neighbours
        self._window = self._window[self._num_read :]
        self._num_read = len(self._window)
        return text[len(seen) :]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(position, stop string) of the first stop string in `text`, whose held-back start
        held none (so a new one ends in what was just decoded)."""
        if not self.stop:
            return None
        hits = [(text.find(s), s) for s in self.stop]
        return min(((pos, s) for pos, s in hits if pos >= 0), default=None)
