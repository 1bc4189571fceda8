"""What `nanoflex plan` says of a vision model's tower: its parameters, bytes and home, and
what one image of the workload costs (policy/vision_cost.py prices the same)."""

from __future__ import annotations

from policy.specs import ModelSpec, WorkloadSpec
from policy.units import format_bytes
from policy.vision import CACHED_IMAGES

TOWER_HOME = "gpu"
"""Where the tower's weights live: the compute device (the gpu tier), resident, as the engine
keeps them (engine/executor/vision_encoder.py); neither side homes it elsewhere yet."""


def vision_summary(model: ModelSpec, workload: WorkloadSpec) -> dict[str, object]:
    """The tower's figures for `nanoflex plan --json`; {} for a text model."""
    tower = model.vision
    if tower is None:
        return {}
    pixels = workload.pixels_per_image
    images = workload.images_per_request
    return {
        "params": tower.params,
        "weight_bytes": tower.params * model.dtype_bytes,
        "home": TOWER_HOME,
        "images_per_request": images,
        "pixels_per_image": pixels,
        "tokens_per_image": tower.tokens_per_image(pixels),
        "flops_per_image": tower.flops_per_image(pixels),
        "cache_bytes": CACHED_IMAGES * tower.feature_bytes(pixels, model.dtype_bytes)
        if images
        else 0,
    }


def vision_lines(model: ModelSpec, workload: WorkloadSpec) -> list[str]:
    """The report's lines on the tower (none for a text model)."""
    tower = model.vision
    if tower is None:
        return []
    line = (
        f"vision tower: {tower.params / 1e9:.2f}B parameters, "
        f"{format_bytes(tower.params * model.dtype_bytes)} of weights, home {TOWER_HOME} "
        "(resident on the compute device, in its memory row)"
    )
    if not workload.images_per_request:
        return [line]
    pixels = workload.pixels_per_image
    cache = CACHED_IMAGES * tower.feature_bytes(pixels, model.dtype_bytes)
    return [
        line,
        f"  per image: {tower.tokens_per_image(pixels)} tokens, "
        f"{tower.flops_per_image(pixels) / 1e12:.2f} TFLOPs in the tower; "
        f"{format_bytes(cache)} of encoded images kept (the engine's last {CACHED_IMAGES})",
    ]


def image_note(model: ModelSpec, workload: WorkloadSpec) -> str:
    """The prompt's image tokens, where there are any."""
    tokens = workload.image_tokens(model)
    if not tokens:
        return ""
    return (
        f" (+ {workload.images_per_request:g} image(s) of {workload.pixels_per_image:,.0f} "
        f"pixels per prompt: {tokens:g} image tokens)"
    )
