"""What `nanoflex plan` says of a vision model's tower: its parameters, bytes, the tier it is
homed and run on and why, and what one image of the workload costs (policy/vision_cost.py
prices the same)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.specs import ModelSpec, WorkloadSpec
from policy.units import format_bytes
from policy.vision import CACHED_IMAGES

if TYPE_CHECKING:
    from policy.search import PlanResult

OTHER_TIER = {"gpu": "cpu", "cpu": "gpu"}


def tower_reason(result: PlanResult) -> str:
    """Why the plan homes the tower where it does: the best predicted generation throughput
    with it on the other tier (the search's alternatives), or that none fits there."""
    tier = result.policy.vision_tier
    other = OTHER_TIER[tier]
    suffix = f"vision_tier={other}"
    rivals = [t for combo, t in result.alternatives.items() if combo.endswith(suffix)]
    if tier == "gpu":
        where = "resident on the compute device, in its memory row"
        if not rivals:
            return f"{where}; no plan with it on the CPU could predict more"
        return f"{where}; on the CPU the best plan predicts {max(rivals):.2f} tok/s"
    where = "homed and run on the CPU, each image's features copied to the GPU"
    if not rivals:
        return f"{where}: with it on the GPU no plan fits the GPU's budget"
    return (
        f"{where}: its GPU share holds weights and KV instead (on the GPU the best plan "
        f"predicts {max(rivals):.2f} tok/s, here {result.predicted['generation_throughput']:.2f})"
    )


def vision_summary(
    model: ModelSpec, workload: WorkloadSpec, result: PlanResult
) -> dict[str, object]:
    """The tower's figures for `nanoflex plan --json`; {} for a text model."""
    tower = model.vision
    if tower is None:
        return {}
    pixels = workload.pixels_per_image
    images = workload.images_per_request
    return {
        "params": tower.params,
        "weight_bytes": tower.params * model.dtype_bytes,
        "home": result.policy.vision_tier,
        "why": tower_reason(result),
        "images_per_request": images,
        "pixels_per_image": pixels,
        "tokens_per_image": tower.tokens_per_image(pixels),
        "flops_per_image": tower.flops_per_image(pixels),
        "cache_bytes": CACHED_IMAGES * tower.feature_bytes(pixels, model.dtype_bytes)
        if images
        else 0,
    }


def vision_lines(model: ModelSpec, workload: WorkloadSpec, result: PlanResult) -> list[str]:
    """The report's lines on the tower (none for a text model)."""
    tower = model.vision
    if tower is None:
        return []
    line = (
        f"vision tower: {tower.params / 1e9:.2f}B parameters, "
        f"{format_bytes(tower.params * model.dtype_bytes)} of weights, "
        f"home {result.policy.vision_tier} ({tower_reason(result)})"
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
