"""`VisionEncoder`: a prompt's images -> the features that take the place of their tokens'
embeddings, each image preprocessed by the checkpoint's own image processor (transformers'
`AutoImageProcessor`: the checkpoint's contract) and run through the vision tower once,
its output cached by the image's digest (the same page in many requests is encoded once).

Five towers: Qwen2.5-VL's and Qwen3-VL's (dynamic resolution, a grid of patches per image;
Qwen3-VL's with DeepStack features), Gemma 3's (a SigLIP ViT over one fixed-size image,
engine/models/gemma3_vision.py), LLaVA's (a CLIP ViT, engine/models/llava.py) and
Idefics3's (a SigLIP-like ViT over each tile of an image, engine/models/idefics3.py).

Placement: the tower is homed on the tier the plan picks (`Policy.vision_tier`, forced by
`--vision-tier`): "gpu", its weights resident on the compute device, read once at start, and
its runs and cache there; "cpu", weights, runs and cache in host memory, each GPU batch's
image rows copied to the compute device as it is staged (`ImageRows.features`). The planner
prices the same (policy/vision_cost.py: the tower's and this cache's bytes in that tier's
budget, its compute at that tier's rate)."""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path

import torch

from engine.core.media import ImageError, ImageInput
from engine.loading.checkpoint import CheckpointReader, DummyReader
from engine.models import gemma3_vision, idefics3, qwen2_5_vision
from engine.models.base import Weights
from engine.models.gemma3_vision import Gemma3VisionTower
from engine.models.idefics3 import Idefics3VisionTower
from engine.models.llava import LlavaVisionTower
from engine.models.qwen2_5_vision import VisionTower
from engine.models.qwen3_vision import Qwen3VisionTower
from engine.models.vision_config import VisionConfig
from engine.models.vit_config import ViTConfig

ViTTower = Gemma3VisionTower | LlavaVisionTower
"""A tower over one fixed-size image (a ViT's): its processor gives (1, C, H, W) pixels."""

CACHED_IMAGES = 256
"""Encoder outputs kept, least recently used dropped first (a few MB each at most)."""

UNUSED = torch.empty(0)
"""The features of an image whose tokens all lie in a sequence's cached prefix: none of its
rows runs, so it is not encoded (`ImageRows` slices no features of it)."""


class VisionEncoder:
    """Images -> (num_tokens, config.feature_width) features on the tower's `device` (the
    compute device, or the host's CPU when the tower is homed there), in `dtype`: the
    embedding's `hidden` columns, then each DeepStack layer's (Qwen3-VL)."""

    def __init__(
        self,
        model_dir: Path,
        config: VisionConfig | ViTConfig,
        reader: CheckpointReader | DummyReader,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        from transformers import AutoImageProcessor

        self.tower: VisionTower | Qwen3VisionTower | ViTTower | Idefics3VisionTower
        if isinstance(config, ViTConfig) and config.projector == "pixel_shuffle":  # tiles
            self.tower, names = Idefics3VisionTower(config), idefics3.vision_weight_name
        elif isinstance(config, ViTConfig):  # Gemma 3's SigLIP or LLaVA's CLIP: one size
            tower = LlavaVisionTower if config.projector == "mlp" else Gemma3VisionTower
            self.tower, names = tower(config), gemma3_vision.vision_weight_name
        elif config.num_position_embeddings:  # Qwen3-VL: learned positions, DeepStack
            self.tower, names = Qwen3VisionTower(config), qwen2_5_vision.vision_weight_name
        else:
            self.tower, names = VisionTower(config), qwen2_5_vision.vision_weight_name
        self.weights: Weights = {}
        for name in reader.names:
            local = names(name)
            if local is not None:
                self.weights[local] = reader.get(name).to(device=device, dtype=dtype)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.device = device
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0
        """Images run through the tower so far (cache hits do not count)."""

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def features(self, image: ImageInput) -> torch.Tensor:
        """(image.num_tokens, feature_width) features of `image` (Idefics3's: one row per
        token of its `runs`, its tiles' in order): cached, or encoded now."""
        cached = self._cache.get(image.digest)
        if cached is not None:
            self._cache.move_to_end(image.digest)
            return cached
        pixels, grid = self._preprocess(image)
        with torch.inference_mode():
            if isinstance(self.tower, Idefics3VisionTower):  # (tiles, C, H, W)
                out = self.tower.encode(self.weights, pixels.to(self.device))
            elif isinstance(self.tower, ViTTower):
                out = self.tower.encode(self.weights, pixels[0].to(self.device))
            else:
                out = self.tower.encode(self.weights, pixels.to(self.device), grid)
        self.num_encoded += 1
        self._cache[image.digest] = out
        if len(self._cache) > CACHED_IMAGES:
            self._cache.popitem(last=False)
        return out

    def _preprocess(self, image: ImageInput) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The image processor's (N, C) patches and (t, h, w) grid (a ViT's: its (1, C, H, W)
        pixels, the grid one frame of the image's tokens); the grid must be the one the daemon
        counted the image's tokens by."""
        from PIL import Image

        picture = Image.open(io.BytesIO(image.data)).convert("RGB")
        if isinstance(self.tower, Idefics3VisionTower):
            return self._tiles(picture, image)
        out = self.processor([picture], return_tensors="pt")
        if isinstance(self.tower, ViTTower):
            if out.get("num_crops") is not None and int(out["num_crops"][0]):
                raise ImageError(
                    "the image processor cut the image into pan-and-scan crops, which nanoflex "
                    "does not run: set do_pan_and_scan false in preprocessor_config.json"
                )
            return out["pixel_values"], image.grid
        grid = tuple(int(n) for n in out["image_grid_thw"][0].tolist())
        if grid != image.grid:
            raise ImageError(
                f"the image processor made a {grid} patch grid of an image counted as "
                f"{image.grid}: the checkpoint's preprocessor_config.json is not one nanoflex reads"
            )
        return out["pixel_values"], (grid[0], grid[1], grid[2])

    def _tiles(
        self, picture: object, image: ImageInput
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Idefics3's (tiles, C, H, W) pixels of one image (its tiles, then its global image);
        its (rows, cols) must be the ones the daemon wrote its prompt by."""
        out = self.processor([[picture]], return_row_col_info=True, return_tensors="pt")
        grid = (1, int(out["rows"][0][0]), int(out["cols"][0][0]))
        if grid != image.grid:
            raise ImageError(
                f"the image processor cut an image into {grid[1:]} tiles, counted as "
                f"{image.grid[1:]}: the checkpoint's preprocessor_config.json is not one "
                "nanoflex reads"
            )
        return out["pixel_values"][0], grid
