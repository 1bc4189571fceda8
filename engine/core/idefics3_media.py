"""Idefics3's and SmolVLM's image splitting, torch-free: how many tiles their image processor
cuts an image of a given size into (its longest edge resized to `longest_edge`, then both
edges up to whole tiles), and the tokens their processor writes for it (each tile's
<fake_token_around_image>, its <row_r_col_c> marker and its image tokens, a newline after
each row, then a newline and the global image between <fake_token_around_image>s).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_IMAGE_SIZE = 4096
"""The processor's cap on an image's longest edge after its first resize (transformers'
Idefics3 `MAX_IMAGE_SIZE`)."""
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


@dataclass(frozen=True, slots=True)
class Tiling:
    """The image processor's splitting rule and the token ids of every prompt it can write.

    An image of (rows, cols) tiles runs rows * cols + 1 tiles through the tower (the tiles
    row by row, then the whole image resized to one tile); (0, 0): the global image alone."""

    tile_size: int
    """Pixels per side of one tile (max_image_size's longest_edge): the tower's image size."""
    longest_edge: int
    """The image's longest edge after the processor's first resize (size's longest_edge)."""
    is_split: bool
    """do_image_splitting: False resizes every image to one tile, the global image alone."""
    tokens_per_tile: int
    """Image tokens per tile (image_seq_len): its patches over the connector's scale**2."""
    prompts: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]
    """((rows, cols), token ids of the prompt written for it) for every grid possible."""

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles the processor cuts an image of `width` x `height` into."""
        if not self.is_split:
            return 0, 0
        height, width = _rescale_to_max_len(height, width, self.longest_edge)
        height, width = _scale_below(height, width, MAX_IMAGE_SIZE)
        tile = self.tile_size
        if width >= height:  # both edges up to whole tiles, as `resize_for_vision_encoder`
            aspect = width / height
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            aspect = width / height
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height <= tile and width <= tile:
            return 0, 0
        return height // tile, width // tile

    def prompt(self, grid: tuple[int, int]) -> tuple[int, ...]:
        """The token ids the processor writes for an image of `grid` tiles."""
        for key, ids in self.prompts:
            if key == grid:
                return ids
        raise ValueError(f"no prompt for a grid of {grid} tiles")  # `grids` covers them all


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge set to `max_len`, the other scaled and rounded up to even."""
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge brought down to `max_len` where it is over it."""
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


def prompt_text(grid: tuple[int, int], tokens_per_tile: int, image_token: str) -> str:
    """The text the processor puts in place of one <image> for an image of `grid` tiles."""
    rows, cols = grid
    image = image_token * tokens_per_tile
    tiles = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image}{FAKE_TOKEN}"
    return f"{tiles}\n{whole}" if rows or cols else whole


def read_tiling(root: Path, processor: dict[str, Any], tokens_per_tile: int) -> Tiling:
    """The tiling of the checkpoint in `root`: its image processor's sizes (`processor`,
    preprocessor_config.json's, unless processor_config.json nests its own, which transformers
    reads first), every prompt tokenized whole by its tokenizer.json (the prompt starts and
    ends with an added token, so it tokenizes alike inside the chat). Raises ValueError where
    the processor's image_seq_len is not the tower's `tokens_per_tile`."""
    from tokenizers import Tokenizer

    nested_file = root / "processor_config.json"
    nested = json.loads(nested_file.read_text()) if nested_file.is_file() else {}
    processor = nested.get("image_processor") or processor
    seq_len = int(nested.get("image_seq_len", tokens_per_tile))
    if seq_len != tokens_per_tile:
        raise ValueError(
            f"the processor's image_seq_len {seq_len} is not the {tokens_per_tile} tokens the "
            "tower gives a tile"
        )
    tile = int((processor.get("max_image_size") or {}).get("longest_edge", 364))
    longest = int((processor.get("size") or {}).get("longest_edge", 4 * tile))
    is_split = bool(processor.get("do_image_splitting", True))
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    if FAKE_TOKEN not in added or "<image>" not in added:
        raise ValueError(f"{root}/tokenizer.json lacks {FAKE_TOKEN} or <image> as added tokens")
    side = math.ceil(min(longest, MAX_IMAGE_SIZE) / tile) if is_split else 0
    grids = [(0, 0)] + [(r, c) for r in range(1, side + 1) for c in range(1, side + 1)]
    texts = [prompt_text(grid, tokens_per_tile, "<image>") for grid in grids]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    prompts = tuple((grid, tuple(e.ids)) for grid, e in zip(grids, encoded, strict=True))
    return Tiling(tile, longest, is_split, tokens_per_tile, prompts)


def feature_runs(prompt: tuple[int, ...], image_token_id: int) -> tuple[tuple[int, int], ...]:
    """(offset, length) of each run of image tokens in `prompt`: one per tile, in order."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(prompt):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return tuple(runs)
