"""Gemma 3's processor's widening of its image placeholders, in tokens, torch-free: each
<start_of_image> the chat template writes becomes two newlines, the marker, the image's
tokens, <end_of_image> and two newlines, the newline runs merged with the newlines beside
them as its tokenizer merges them (it widens the text before tokenizing)."""

from __future__ import annotations

from pathlib import Path

MAX_NEWLINES = 31
"""The longest newline run looked up in a tokenizer (Gemma's has tokens up to 31)."""


def newline_runs(tokenizer_file: Path) -> tuple[tuple[int, ...], ...]:
    """The token ids of 1, 2, ... `MAX_NEWLINES` newlines, as `tokenizer_file` writes them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return tuple(
        tuple(tokenizer.encode("\n" * n, add_special_tokens=False).ids)
        for n in range(1, MAX_NEWLINES + 1)
    )


def newlines(runs: tuple[tuple[int, ...], ...], count: int) -> list[int]:
    """The token ids of `count` newlines (`runs` as `newline_runs`)."""
    out: list[int] = []
    while count > 0:
        take = min(count, len(runs))
        out += runs[take - 1]
        count -= take
    return out


def widen_placeholders(
    token_ids: list[int],
    pads: list[int],
    image_tokens: list[int],
    begin_end: tuple[int, int],
    runs: tuple[tuple[int, ...], ...],
) -> tuple[list[int], list[int]]:
    """(the prompt with each placeholder at `pads` widened to its image's `image_tokens`
    between `begin_end` and two newlines each side, where each image's tokens start)."""
    counts = {run[0]: n for n, run in enumerate(runs, 1) if len(run) == 1}
    out: list[int] = []
    starts: list[int] = []
    index = 0
    for pad in pads:
        out += token_ids[index:pad]
        before = 0
        while out and out[-1] in counts:  # the newlines before it join the two it adds
            before += counts[out.pop()]
        index = pad + 1
        after = 0
        while index < len(token_ids) and token_ids[index] in counts and index not in pads:
            after += counts[token_ids[index]]
            index += 1
        out += [*newlines(runs, before + 2), begin_end[0]]
        starts.append(len(out))
        out += [*image_tokens, begin_end[1], *newlines(runs, after + 2)]
    return out + token_ids[index:], starts
