"""Images in a prompt, torch-free: what the daemon works out from an image's size and the
checkpoint's processor config (the grid of patches, so the number of image tokens), the record
that carries an image to the engine (`ImageInput`, `SeqMedia`), Qwen2.5-VL's multimodal rotary
positions (M-RoPE), and the token ids the prefix cache keys a prompt by (an image's pad tokens
stand for that image's digest, so two images never share a cached page).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from base.errors import UserError
from engine.core.gemma3_media import newline_runs, widen_placeholders
from engine.core.idefics3_media import Tiling, feature_runs, read_tiling

VISION_MODEL_TYPES = (
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma3",
    "llava",
    "idefics3",
    "smolvlm",
)
"""Checkpoints whose vision tower nanoflex runs (the others with one run their text alone)."""


class ImageError(UserError):
    """An image the model cannot take: too many pixels, an aspect ratio past its processor's."""


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """What the daemon needs of a vision checkpoint to turn images into prompt tokens: its
    special tokens and its processor's resizing rule (transformers' Qwen2-VL `smart_resize`)."""

    image_token_id: int
    """The image-pad token: the chat template writes one per image, widened to its tokens."""
    patch_size: int
    """Pixels per patch side (14)."""
    merge_size: int
    """Patches per merged token side (2): one image token is merge_size**2 patches."""
    temporal_patch_size: int
    """Frames per patch (2: a still image is repeated)."""
    min_pixels: int
    max_pixels: int
    """The processor resizes every image into this pixel budget."""
    tokens_per_image: int = 0
    """Gemma 3 and LLaVA: every image is resized to one size and gives this many image
    tokens; 0: a grid of patches per image (Qwen2.5-VL, M-RoPE)."""
    bidirectional: bool = False
    """Gemma 3: the tokens of one image attend to each other both ways."""
    placeholder_id: int = -1
    """The token the chat template writes per image (Gemma 3's <start_of_image>); -1: the
    image token itself."""
    begin_end_ids: tuple[int, int] = (-1, -1)
    """Gemma 3: the tokens around an image's tokens, <start_of_image> and <end_of_image>, each
    beside two newlines, as its processor writes the placeholder; (-1, -1): none."""
    newline_runs: tuple[tuple[int, ...], ...] = ()
    """The tokenizer's ids of 1, 2, ... newlines (engine/core/gemma3_media.py): the processor
    widens the placeholder in the text before tokenizing, so the newlines it adds merge with
    their neighbours into one token where the tokenizer has one."""
    tiling: Tiling | None = None
    """Idefics3 and SmolVLM: each image cut into tiles and a global image, its <image> widened
    to their markers and image tokens (engine/core/idefics3_media.py); None: no tiles."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> VisionSpec | None:
        """The spec of the checkpoint in `model_dir`, or None for a model without a vision
        tower nanoflex runs (config.json's model_type; preprocessor_config.json)."""
        root = Path(model_dir)
        try:
            config = json.loads((root / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if config.get("model_type") not in VISION_MODEL_TYPES:
            return None
        if config["model_type"] == "gemma3" and not has_image_processor(root):
            return None  # Gemma 3 without its processor files: its language model on text
        vision = config.get("vision_config") or {}
        try:
            processor: dict[str, Any] = json.loads((root / "preprocessor_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ImageError(
                f"{root} has a vision tower but no readable preprocessor_config.json ({e}); "
                "copy the checkpoint's processor files beside its weights"
            ) from e
        if config["model_type"] == "gemma3":
            return cls._gemma3(root, config, processor)
        if config["model_type"] == "llava":
            return cls._llava(config)
        if config["model_type"] in ("idefics3", "smolvlm"):
            return cls._idefics3(root, config, processor)
        size = processor.get("size") or {}
        return cls(
            image_token_id=int(config["image_token_id"]),
            patch_size=int(processor.get("patch_size", vision.get("patch_size", 14))),
            merge_size=int(processor.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(processor.get("temporal_patch_size", 2)),
            min_pixels=int(processor.get("min_pixels") or size.get("shortest_edge", 56 * 56)),
            max_pixels=int(processor.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)),
        )

    @classmethod
    def _gemma3(cls, root: Path, config: dict[str, Any], processor: dict[str, Any]) -> VisionSpec:
        """Gemma 3's: one size for every image, mm_tokens_per_image tokens each, written as its
        processor writes them (engine/core/gemma3_media.py)."""
        if processor.get("do_pan_and_scan"):
            raise ImageError(
                f"{root}: Gemma 3's pan-and-scan crops are not supported; set do_pan_and_scan "
                "false in preprocessor_config.json"
            )
        size = int((config.get("vision_config") or {}).get("image_size", 896))

        def token(name: str) -> int:  # transformers writes <name>_index, older files <name>_id
            return int(config.get(f"{name}_index", config.get(f"{name}_id", -1)))

        return cls(
            image_token_id=token("image_token"),
            patch_size=size,
            merge_size=1,
            temporal_patch_size=1,
            min_pixels=size * size,
            max_pixels=size * size,
            tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
            bidirectional=True,
            placeholder_id=token("boi_token"),
            begin_end_ids=(token("boi_token"), token("eoi_token")),
            newline_runs=newline_runs(root / "tokenizer.json"),
        )

    @classmethod
    def _llava(cls, config: dict[str, Any]) -> VisionSpec:
        """LLaVA's: every image resized and cropped to the CLIP tower's size, one token per
        patch (and one for the class token where vision_feature_select_strategy is 'full'),
        the chat template's <image> widened to them (transformers' `LlavaProcessor`)."""
        vision = config.get("vision_config") or {}
        size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        full = config.get("vision_feature_select_strategy", "default") == "full"
        image_token = config.get("image_token_index", config.get("image_token_id", 32000))
        return cls(
            image_token_id=int(image_token),
            patch_size=size,
            merge_size=1,
            temporal_patch_size=1,
            min_pixels=size * size,
            max_pixels=size * size,
            tokens_per_image=(size // patch) ** 2 + full,
        )

    @classmethod
    def _idefics3(cls, root: Path, config: dict[str, Any], processor: dict[str, Any]) -> VisionSpec:
        """Idefics3's and SmolVLM's: every image cut into tiles of the tower's size and a global
        image, image_seq_len tokens each (their patches pixel-shuffled `scale_factor`**2 into
        one), written with their markers as the processor writes them."""
        vision = config.get("vision_config") or {}
        size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        per_tile = (size // patch) ** 2 // int(config.get("scale_factor", 2)) ** 2
        try:
            tiling = read_tiling(root, processor, per_tile)
        except (OSError, ValueError) as e:
            raise ImageError(f"{root}: its image tiles cannot be written ({e})") from e
        if tiling.tile_size != size:
            raise ImageError(
                f"{root}: the processor's tiles of {tiling.tile_size} px (max_image_size) are "
                f"not the tower's image_size {size}"
            )
        return cls(
            image_token_id=int(config.get("image_token_id", 128257)),
            patch_size=size,
            merge_size=1,
            temporal_patch_size=1,
            min_pixels=size * size,
            max_pixels=tiling.longest_edge**2,
            tiling=tiling,
        )

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) patches of an image of `width` x `height` pixels once resized, as the
        processor resizes it (transformers' `smart_resize`); Gemma 3's: its tokens' square,
        whatever the image's size; Idefics3's: (1, rows, cols) of its tiles."""
        if self.tiling is not None:
            return 1, *self.tiling.grid(width, height)
        if self.tokens_per_image:
            side = math.isqrt(self.tokens_per_image)
            return 1, side, self.tokens_per_image // side
        factor = self.patch_size * self.merge_size
        if max(height, width) / max(1, min(height, width)) > 200:
            raise ImageError(
                f"an image of {width}x{height} pixels is too elongated: the processor takes an "
                "aspect ratio under 200"
            )
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return 1, h_bar // self.patch_size, w_bar // self.patch_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of an image of `grid` patches (merge_size**2 patches each)."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt, as the engine receives it."""

    data: bytes
    """The image file as sent (PNG, JPEG...): the engine decodes and preprocesses it with the
    checkpoint's own image processor."""
    digest: str
    """blake2b of `data`: the key of its encoder output and of its prefix-cache pages."""
    grid: tuple[int, int, int]
    """(t, h, w) patches after the processor's resize (`VisionSpec.grid`)."""
    start: int
    """Index in the prompt of its first image token."""
    num_tokens: int
    """Its image tokens: t * h * w / merge_size**2, contiguous from `start` (Idefics3's: its
    whole prompt, markers included)."""
    runs: tuple[tuple[int, int], ...] = ()
    """Idefics3: (offset from `start`, length) of each tile's image tokens, which take the
    encoder's features in order (the markers between them keep their embeddings); (): every
    token of the image takes a feature."""

    def feature_spans(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """(prompt index, feature index, count) of each run of its tokens within the prompt's
        [first, last) that take features (`runs`)."""
        out: list[tuple[int, int, int]] = []
        feature = 0
        for offset, length in self.runs or ((0, self.num_tokens),):
            begin = self.start + offset
            low, high = max(first, begin), min(last, begin + length)
            if low < high:
                out.append((low, feature + low - begin, high - low))
            feature += length
        return out


@dataclass(frozen=True, slots=True)
class SeqMedia:
    """The images of one prompt, in prompt order, and their M-RoPE positions."""

    images: tuple[ImageInput, ...]
    positions: tuple[tuple[int, int, int], ...]
    """(t, h, w) rotary position of every prompt token (`mrope_positions`)."""
    delta: int
    """A token past the prompt at index p has position p + delta on all three axes."""
    bidirectional: bool = False
    """The tokens of one image attend to each other both ways (Gemma 3): a prefill chunk
    never ends inside an image (`whole_images`)."""

    def whole_images(self, start: int, num_new: int) -> int:
        """How many of the `num_new` tokens from `start` a prefill chunk may run: all of them,
        or, where they end inside an image whose tokens attend both ways, up to that image's
        start (0 where the chunk starts inside it: it waits for a budget that covers it)."""
        if not self.bidirectional:
            return num_new
        end = start + num_new
        for image in self.images:
            if image.start < end < image.start + image.num_tokens:
                return max(0, image.start - start)
        return num_new

    def position(self, index: int) -> tuple[int, int, int]:
        """The (t, h, w) position of the sequence's token at `index` (prompt or generated)."""
        if index < len(self.positions):
            return self.positions[index]
        p = index + self.delta
        return p, p, p


def has_image_processor(model_dir: str | Path) -> bool:
    """Whether the checkpoint ships its image processor's config (Gemma 3's may be run as its
    language model alone without it)."""
    return (Path(model_dir) / "preprocessor_config.json").is_file()


def image_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def expand_image_tokens(
    token_ids: list[int], spec: VisionSpec, images: list[tuple[bytes, int, int]]
) -> SeqMedia | None:
    """Widen each image-pad token of a rendered chat (`token_ids`, changed in place) to its
    image's tokens, as the processor does; `images`: (file bytes, width, height) of each in
    order. Returns the prompt's `SeqMedia`, None without images. The count of pads must
    equal the count of images."""
    placeholder = spec.image_token_id if spec.placeholder_id < 0 else spec.placeholder_id
    pads = [i for i, t in enumerate(token_ids) if t == placeholder]
    if len(pads) != len(images):
        raise ImageError(
            f"the chat template wrote {len(pads)} image placeholder(s) for {len(images)} "
            "image(s); the model's template must write one per image part"
        )
    if not images:
        return None
    if spec.bidirectional:  # Gemma 3: one size of image, its processor's markers around it
        count = spec.tokens_per_image
        widened, starts = widen_placeholders(
            token_ids, pads, [spec.image_token_id] * count, spec.begin_end_ids, spec.newline_runs
        )
        token_ids[:] = widened
        found = tuple(
            ImageInput(data, image_digest(data), spec.grid(width, height), start, count)
            for start, (data, width, height) in zip(starts, images, strict=True)
        )
        return SeqMedia(found, (), 0, bidirectional=True)
    if spec.tokens_per_image:  # LLaVA: one size of image, its placeholder widened in place
        return _widen_in_place(token_ids, spec, images)
    if spec.tiling is not None:  # Idefics3: tiles and a global image, with their markers
        return _widen_tiles(token_ids, pads, spec, spec.tiling, images)
    out: list[ImageInput] = []
    shift = 0
    for pad, (data, width, height) in zip(pads, images, strict=True):
        grid = spec.grid(width, height)
        count = spec.num_tokens(grid)
        start = pad + shift
        token_ids[start : start + 1] = [spec.image_token_id] * count
        out.append(ImageInput(data, image_digest(data), grid, start, count))
        shift += count - 1
    positions, delta = mrope_positions(len(token_ids), out, spec.merge_size)
    return SeqMedia(tuple(out), positions, delta)


def _widen_in_place(
    token_ids: list[int], spec: VisionSpec, images: list[tuple[bytes, int, int]]
) -> SeqMedia:
    """Each image token of `token_ids` (changed in place) widened to `spec.tokens_per_image`
    of them; the prompt's positions stay one per token."""
    count = spec.tokens_per_image
    found: list[ImageInput] = []
    out: list[int] = []
    for token in token_ids:
        if token != spec.image_token_id:
            out.append(token)
            continue
        data, width, height = images[len(found)]
        grid = spec.grid(width, height)
        found.append(ImageInput(data, image_digest(data), grid, len(out), count))
        out += [token] * count
    token_ids[:] = out
    return SeqMedia(tuple(found), (), 0)


def _widen_tiles(
    token_ids: list[int],
    pads: list[int],
    spec: VisionSpec,
    tiling: Tiling,
    images: list[tuple[bytes, int, int]],
) -> SeqMedia:
    """Each <image> of `token_ids` (changed in place) widened to the prompt the processor
    writes for its tiles; positions stay one per token."""
    found: list[ImageInput] = []
    shift = 0
    for pad, (data, width, height) in zip(pads, images, strict=True):
        grid = spec.grid(width, height)
        prompt = tiling.prompt(grid[1:])
        start = pad + shift
        token_ids[start : start + 1] = prompt
        runs = feature_runs(prompt, spec.image_token_id)
        found.append(ImageInput(data, image_digest(data), grid, start, len(prompt), runs))
        shift += len(prompt) - 1
    return SeqMedia(tuple(found), (), 0)


def mrope_positions(
    num_tokens: int, images: list[ImageInput], merge_size: int
) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """Qwen2.5-VL's (and Qwen3-VL's, for still images) rotary positions of a prompt of
    `num_tokens` with `images` (transformers' `get_rope_index`): text advances one on all
    three axes; an image's tokens, row by row over its merged grid, sit at (p, p + row,
    p + column) from the position p it starts at; the text after it starts at
    p + max(rows, columns). Returns (positions, delta), delta the offset of the positions
    past the prompt from their index."""
    positions: list[tuple[int, int, int]] = []
    next_pos = 0
    index = 0
    for image in images:
        while index < image.start:
            positions.append((next_pos, next_pos, next_pos))
            next_pos, index = next_pos + 1, index + 1
        t, h, w = image.grid
        rows, cols = h // merge_size, w // merge_size
        for frame in range(t):
            for r in range(rows):
                for c in range(cols):
                    positions.append((next_pos + frame, next_pos + r, next_pos + c))
        index += image.num_tokens
        next_pos += max(rows, cols)
    while index < num_tokens:
        positions.append((next_pos, next_pos, next_pos))
        next_pos, index = next_pos + 1, index + 1
    return tuple(positions), next_pos - num_tokens


def cache_token_ids(token_ids: list[int], media: SeqMedia | None) -> list[int]:
    """The token ids the prefix cache hashes a sequence by: its own, with each image's tokens
    replaced by a key of the image's digest (negative: no vocabulary id, nor the pending
    token's -1), so pages over two different images never hash alike."""
    if media is None:
        return token_ids
    out = list(token_ids)
    for image in media.images:
        key = -2 - int(image.digest[:15], 16)
        end = min(len(out), image.start + image.num_tokens)
        out[image.start : end] = [key] * max(0, end - image.start)
    return out
