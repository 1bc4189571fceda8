"""The vision tower's terms of the cost model: its weights and the encoded images it keeps on
the compute device, and the seconds a block's images take through it (policy/vision.py has
the tower's shapes).

The engine keeps the tower resident on the compute device (engine/executor/vision_encoder.py)
and runs each image once before the prefill that needs it; the planner prices the same: the
tower's bytes are a constant of the compute device's memory rows, whatever the placement of
the layers, and its compute is serial work of the prefill. An image's tokens are part of its
prompt (`WorkloadSpec.prompt_tokens`): their KV, prefill and attention are priced as text's.
Every image is taken as distinct (the engine encodes a repeated one once: a job of the same
page many times runs faster than priced).
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.hardware import HardwareSpec
from policy.specs import ModelSpec, WorkloadSpec
from policy.vision import CACHED_IMAGES


@dataclass(frozen=True)
class TowerCost:
    """What a vision model's tower costs one block; zeros for a text model."""

    weight_bytes: int = 0
    """The tower's weights in the compute dtype, homed on the compute device."""
    cache_bytes: int = 0
    """Encoded images the engine keeps there (CACHED_IMAGES of the workload's size); 0
    without images."""
    workspace_bytes: int = 0
    """One image's widest intermediates while the tower runs (during a prefill)."""
    block_seconds: float = 0.0
    """Compute device seconds to encode the block's images (bls x images per request)."""
    image_tokens: float = 0.0
    """Tokens of one prompt's images (already in the priced prompt length)."""

    @property
    def prefill_bytes(self) -> int:
        """On the compute device during a prefill: weights, cache and workspace."""
        return self.weight_bytes + self.cache_bytes + self.workspace_bytes

    @property
    def decode_bytes(self) -> int:
        """On the compute device during a decode step: weights and cache."""
        return self.weight_bytes + self.cache_bytes


def tower_cost(
    model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, block_size: int
) -> TowerCost:
    """The tower's terms for a block of `block_size` sequences of `workload`: one image at a
    time, FLOP-bound (2 per parameter per patch, attention's per key) or bound by reading the
    tower's weights, whichever is slower."""
    tower = model.vision
    if tower is None:
        return TowerCost()
    dtype = model.dtype_bytes
    weight_bytes = tower.params * dtype
    images = workload.images_per_request
    if not images:
        return TowerCost(weight_bytes=weight_bytes)
    pixels = workload.pixels_per_image
    flops = tower.flops_per_image(pixels)
    per_image = max(flops / hardware.gpu_flops, weight_bytes / hardware.gpu_mem_bw_estimate)
    return TowerCost(
        weight_bytes=weight_bytes,
        cache_bytes=CACHED_IMAGES * tower.feature_bytes(pixels, dtype),
        workspace_bytes=tower.workspace_bytes(pixels, dtype),
        block_seconds=block_size * images * per_image,
        image_tokens=workload.image_tokens(model),
    )
