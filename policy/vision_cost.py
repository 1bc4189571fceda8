"""The vision tower's terms of the cost model: its weights and the encoded images it keeps,
and the seconds a block's images take through it, on the tier the policy homes it on
(`Policy.vision_tier`; policy/vision.py has the tower's shapes).

The engine runs each image once before the prefill that needs it (engine/executor/
vision_encoder.py), on the tower's tier: "gpu", resident on the compute device, its bytes a
constant of the device's memory rows whatever the placement of the layers; "cpu", homed in
host memory and run by the CPU, its bytes in the host's rows and its compute at the CPU's
rate, each image's features copied to the device. Either way its compute is serial work of
the prefill. An image's tokens are part of its prompt (`WorkloadSpec.prompt_tokens`): their
KV, prefill and attention are priced as text's. Every image is taken as distinct (the
engine encodes a repeated one once: a job of the same page many times runs faster than
priced).
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
    """The tower's weights in the compute dtype, homed on its tier."""
    cache_bytes: int = 0
    """Encoded images the engine keeps on the tower's tier (CACHED_IMAGES of the workload's
    size); 0 without images."""
    workspace_bytes: int = 0
    """One image's widest intermediates while the tower runs (during a prefill)."""
    block_seconds: float = 0.0
    """Seconds to encode the block's images (bls x images per request) on the tower's tier,
    and from the host, to copy their features to the compute device."""
    image_tokens: float = 0.0
    """Tokens of one prompt's images (already in the priced prompt length)."""
    tier: str = "gpu"
    """Where the tower lives: the memory rows its bytes are in ("gpu" or "cpu")."""

    @property
    def prefill_bytes(self) -> int:
        """On the tower's tier during a prefill: weights, cache and workspace."""
        return self.weight_bytes + self.cache_bytes + self.workspace_bytes

    @property
    def decode_bytes(self) -> int:
        """On the tower's tier during a decode step: weights and cache."""
        return self.weight_bytes + self.cache_bytes

    def memory_rows(self) -> dict[str, int]:
        """Bytes added to the cost model's memory rows (`{tier}_prefill`, `{tier}_decode`)."""
        tier = self.tier
        return {f"{tier}_prefill": self.prefill_bytes, f"{tier}_decode": self.decode_bytes}


def tower_cost(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    block_size: int,
    tier: str = "gpu",
) -> TowerCost:
    """The tower's terms for a block of `block_size` sequences of `workload` with the tower on
    `tier`: one image at a time, FLOP-bound (2 per parameter per patch, attention's per key)
    or bound by reading the tower's weights, whichever is slower, at that tier's rates; on
    the CPU, plus copying the image's features to the compute device."""
    tower = model.vision
    if tower is None:
        return TowerCost()
    dtype = model.dtype_bytes
    weight_bytes = tower.params * dtype
    images = workload.images_per_request
    if not images:
        return TowerCost(weight_bytes=weight_bytes, tier=tier)
    pixels = workload.pixels_per_image
    flops = tower.flops_per_image(pixels)
    features = tower.feature_bytes(pixels, dtype)
    if tier == "cpu":
        per_image = max(flops / hardware.cpu_flops, weight_bytes / hardware.cpu_mem_bw_estimate)
        per_image += features / hardware.ctog_bw
    else:
        per_image = max(flops / hardware.gpu_flops, weight_bytes / hardware.gpu_mem_bw_estimate)
    return TowerCost(
        weight_bytes=weight_bytes,
        cache_bytes=CACHED_IMAGES * features,
        workspace_bytes=tower.workspace_bytes(pixels, dtype),
        block_seconds=block_size * images * per_image,
        image_tokens=workload.image_tokens(model),
        tier=tier,
    )
