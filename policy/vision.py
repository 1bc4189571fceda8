"""`VisionSpec`: the shapes of a vision-language model's vision tower, read from the
`vision_config` of its config.json, and what the tower costs: its parameters, the tokens and
FLOPs of one image, and the bytes it holds on the compute device.

One record serves every tower of ViT blocks (attention and an MLP, two norms each) between a
patch embedding and a projector into the language model; each family has a reader in
`READERS` (Qwen2.5-VL's; Gemma 3's SigLIP, Qwen3-VL's and LLaVA's CLIP are the same blocks
with a learned position table, LayerNorms and a plain MLP: `position_params`, `norm_params`,
`gated_mlp`), not a record of its own.

Legend: P patches of one image, T = P / m^2 its tokens (m the merge size), h the tower's
width, f its MLP's, W the patches one windowed block's attention spans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_IMAGE_PIXELS = 1024 * 1024
"""Pixels of one image when the workload does not say (a page scan at about 100 dpi, or a
phone photo as Qwen2.5-VL's processor keeps it: well under its 12.8 M pixel cap)."""
CACHED_IMAGES = 256
"""Images whose tower output the engine keeps on the compute device, by digest
(engine/executor/vision_encoder.py's CACHED_IMAGES; a test holds the two equal)."""


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower's shapes (transformers' vision config), enough to count its parameters
    and price one image; resident on the compute device, as the engine runs it."""

    depth: int
    """Transformer blocks."""
    hidden_size: int
    intermediate_size: int
    """MLP inner width."""
    num_heads: int
    patch_size: int
    """Pixels per patch side."""
    out_hidden_size: int
    """The language model's hidden size: the width of one image token."""
    in_channels: int = 3
    temporal_patch_size: int = 1
    """Frames per patch (Qwen's 2: a still image is repeated)."""
    merge_size: int = 1
    """Patches per token side: the projector merges m x m patches into one token."""
    window_patches: int = 0
    """Patches one windowed block attends over (Qwen2.5-VL: (112 / 14)^2 = 64); 0: none."""
    num_full_attention_blocks: int = 0
    """Blocks that attend over the whole image (the others: within their window); all
    `depth` where window_patches is 0."""
    gated_mlp: bool = True
    """SwiGLU (gate, up, down) rather than up and down."""
    linear_bias: bool = True
    """The blocks' projections carry biases."""
    norm_params: int = 1
    """Parameters per channel of a norm: 1 (RMSNorm) or 2 (LayerNorm, with a bias)."""
    projector_params: int = 0
    """Parameters after the blocks: the merger or projector into the language model."""
    position_params: int = 0
    """A learned position table (SigLIP's, Qwen3-VL's); 0 for rotary positions alone."""
    patch_bias: bool = False
    """The patch embedding carries a bias (SigLIP's, Qwen3-VL's)."""
    fixed_image_tokens: int = 0
    """Tokens every image takes whatever its size (Gemma 3's 256: images are resized to the
    tower's square); 0: dynamic resolution, tokens from the image's pixels."""
    unrun_blocks: int = 0
    """Blocks past the layer the projector reads (LLaVA's `vision_feature_layer` -2: the
    last), loaded with the tower but never run: in its parameters, not its FLOPs."""

    # ---- parameters ------------------------------------------------------------------

    @property
    def patch_embed_params(self) -> int:
        """The patch embedding: a convolution from c t p p pixels to h (and its bias)."""
        p, h = self.patch_size, self.hidden_size
        return self.in_channels * self.temporal_patch_size * p * p * h + (
            h if self.patch_bias else 0
        )

    @property
    def block_linear_params(self) -> int:
        """One block's projections: q, k, v, o (4 h^2) and the MLP (3 h f gated, else 2)."""
        h, f = self.hidden_size, self.intermediate_size
        mlp = (3 if self.gated_mlp else 2) * h * f
        return 4 * h * h + mlp

    @property
    def block_params(self) -> int:
        """One block: its projections, their biases, two norms."""
        h, f = self.hidden_size, self.intermediate_size
        bias = 4 * h + ((2 if self.gated_mlp else 1) * f + h) if self.linear_bias else 0
        return self.block_linear_params + bias + 2 * self.norm_params * h

    @property
    def params(self) -> int:
        """Parameters of the whole tower (transformers' count of its vision model)."""
        blocks = self.depth * self.block_params
        return self.patch_embed_params + blocks + self.projector_params + self.position_params

    # ---- one image ---------------------------------------------------------------------

    def tokens_per_image(self, pixels: float) -> int:
        """Tokens one image of `pixels` pixels takes in the prompt: a square image cut into
        patches, m x m of them merged into a token (or the family's fixed count)."""
        if self.fixed_image_tokens:
            return self.fixed_image_tokens
        side = self.patch_size * self.merge_size  # pixels per token side (Qwen: 28)
        return max(1, round(math.sqrt(pixels) / side)) ** 2

    def patches_per_image(self, pixels: float) -> int:
        """P: the patches the blocks run over for one image."""
        return self.tokens_per_image(pixels) * self.merge_size**2

    def flops_per_image(self, pixels: float) -> float:
        """FLOPs of running one image through the tower: 2 per parameter per patch (the
        projector per token), and attention's 4 P h per key, over the whole image in full
        blocks and over W patches in windowed ones."""
        patches = self.patches_per_image(pixels)
        depth = self.depth - self.unrun_blocks
        full = self.num_full_attention_blocks if self.window_patches else depth
        window = min(patches, self.window_patches) if self.window_patches else patches
        keys = full * patches + (depth - full) * window  # summed over the blocks
        dense = self.patch_embed_params + depth * self.block_linear_params
        projector = self.projector_params * patches / self.merge_size**2
        return 2 * (patches * dense + projector) + 4 * patches * keys * self.hidden_size

    def workspace_bytes(self, pixels: float, dtype_bytes: int) -> int:
        """A block's widest intermediates for one image while it runs: the residual, q, k,
        v and the MLP's inner rows (attention runs fused: no P x P scores)."""
        h, f = self.hidden_size, self.intermediate_size
        width = 2 * h + max(3 * h, (2 if self.gated_mlp else 1) * f)
        return self.patches_per_image(pixels) * width * dtype_bytes

    def feature_bytes(self, pixels: float, dtype_bytes: int) -> int:
        """One image's tower output: its tokens' rows of the language model's width."""
        return self.tokens_per_image(pixels) * self.out_hidden_size * dtype_bytes


def _merger(width: int, out: int) -> int:
    """A Qwen merger's projections: width -> width -> out, with biases (GELU between)."""
    return width * width + width + width * out + out


def _qwen2_5_vl(model: dict[str, Any]) -> VisionSpec:
    """Qwen2.5-VL's (transformers' Qwen2_5_VLVisionConfig; `in_chans` in older files):
    RMSNorm blocks with SwiGLU, biases on every projection, windowed attention but for
    `fullatt_block_indexes`, and a merger (RMSNorm, h m^2 -> h m^2 -> out, GELU between)."""
    config = model["vision_config"]
    hidden, merge = int(config["hidden_size"]), int(config.get("spatial_merge_size", 2))
    patch = int(config.get("patch_size", 14))
    out = int(config["out_hidden_size"])
    merged = hidden * merge * merge
    window = int(config.get("window_size", 112)) // patch
    return VisionSpec(
        depth=int(config["depth"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_heads=int(config["num_heads"]),
        patch_size=patch,
        out_hidden_size=out,
        in_channels=int(config.get("in_channels") or config.get("in_chans") or 3),
        temporal_patch_size=int(config.get("temporal_patch_size", 2)),
        merge_size=merge,
        window_patches=window * window,
        num_full_attention_blocks=len(config.get("fullatt_block_indexes") or ()),
        projector_params=hidden + _merger(merged, out),
    )


def _qwen3_vl(model: dict[str, Any]) -> VisionSpec:
    """Qwen3-VL's and Qwen3-VL-MoE's (transformers' Qwen3VLVisionConfig): LayerNorm blocks
    with a plain GELU MLP, biases everywhere, full attention in every block, a learned
    position table beside the rotary positions, 16-pixel patches merged 2 x 2; a merger
    (LayerNorm of h, then h m^2 -> h m^2 -> out) and one DeepStack merger per
    `deepstack_visual_indexes` (its LayerNorm over the merged h m^2)."""
    config = model["vision_config"]
    hidden, merge = int(config["hidden_size"]), int(config.get("spatial_merge_size", 2))
    out = int(config["out_hidden_size"])
    merged = hidden * merge * merge
    deepstack = len(config.get("deepstack_visual_indexes") or ())
    # the merger's LayerNorm over h, each DeepStack merger's over h m^2
    projector = 2 * hidden + _merger(merged, out) + deepstack * (2 * merged + _merger(merged, out))
    return VisionSpec(
        depth=int(config["depth"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_heads=int(config["num_heads"]),
        patch_size=int(config.get("patch_size", 16)),
        out_hidden_size=out,
        in_channels=int(config.get("in_channels", 3)),
        temporal_patch_size=int(config.get("temporal_patch_size", 2)),
        merge_size=merge,
        gated_mlp=False,
        norm_params=2,
        projector_params=projector,
        position_params=int(config.get("num_position_embeddings", 2304)) * hidden,
        patch_bias=True,
    )


def _gemma3(model: dict[str, Any]) -> VisionSpec:
    """Gemma 3's SigLIP (transformers' SiglipVisionConfig): LayerNorm blocks with a plain MLP,
    biases everywhere, a learned position per patch of the `image_size` square every image is
    resized to, a final LayerNorm; its patch grid average-pooled to `mm_tokens_per_image`
    tokens (a pooling of m x m patches, no parameters), Gemma's RMSNorm and one projection
    h -> out (no bias). `vision_use_head` (transformers' default; Gemma 3's files turn it
    off) adds SigLIP's attention-pooling head, which transformers counts though nothing
    reads it."""
    config = model["vision_config"]
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    patch, image = int(config.get("patch_size", 14)), int(config.get("image_size", 896))
    tokens = int(model.get("mm_tokens_per_image", 256))
    side, token_side = image // patch, math.isqrt(tokens)
    if image % patch or token_side**2 != tokens or side % token_side:
        raise ValueError(
            f"mm_tokens_per_image {tokens} does not pool {side} x {side} patches of {patch} pixels"
        )
    out = int(model.get("text_config", {}).get("hidden_size", 2304))
    head = 0
    if config.get("vision_use_head", True):
        # probe, fused q/k/v and out projections with biases, a LayerNorm, an MLP
        head = hidden + 4 * hidden * hidden + 4 * hidden + 2 * hidden + 2 * hidden * inter
        head += inter + hidden
    return _siglip(
        config,
        out,
        merge_size=side // token_side,
        projector_params=2 * hidden + hidden + hidden * out + head,
        position_params=side * side * hidden,
        fixed_image_tokens=tokens,
    )


def _idefics3(model: dict[str, Any]) -> VisionSpec:
    """Idefics3's and SmolVLM's SigLIP-like tower (transformers' Idefics3VisionConfig): Gemma
    3's blocks (LayerNorms, a plain MLP, biases), a learned position per patch of one tile,
    run over each tile alone (the attention spans a tile: `window_patches`); the connector's
    pixel shuffle (scale_factor**2 patches a token, no parameters) and one projection
    h s^2 -> out (no bias). A square image is resized to the processor's longest edge
    (vision_config's `size`, else the processor's default of 4 tiles) and cut into whole
    tiles, plus the global image: ((longest / tile)^2 + 1) tiles whatever its pixels."""
    config = model["vision_config"]
    hidden = int(config["hidden_size"])
    patch, tile = int(config.get("patch_size", 14)), int(config.get("image_size", 384))
    scale = int(model.get("scale_factor", 2))
    side = tile // patch
    if tile % patch or side % scale:
        raise ValueError(f"scale_factor {scale} does not shuffle {side} x {side} patches")
    longest = int((config.get("size") or {}).get("longest_edge", 4 * tile))
    per_side = math.ceil(min(longest, 4096) / tile)
    tiles = per_side * per_side + 1 if per_side > 1 else 1
    out = int(model.get("text_config", {}).get("hidden_size", 2048))
    return _siglip(
        config,
        out,
        merge_size=scale,
        window_patches=side * side,
        projector_params=2 * hidden + hidden * scale * scale * out,  # the final LayerNorm
        position_params=side * side * hidden,
        fixed_image_tokens=tiles * (side // scale) ** 2,
    )


def _siglip(config: dict[str, Any], out: int, **connector: Any) -> VisionSpec:
    """A SigLIP tower's `VisionSpec` (Gemma 3's, Idefics3's): LayerNorm blocks with a plain
    MLP, biases everywhere (the patch embedding's too); `connector`: the family's fields past
    the blocks (merge size, projector and position parameters, tokens per image)."""
    return VisionSpec(
        depth=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_heads=int(config["num_attention_heads"]),
        patch_size=int(config.get("patch_size", 14)),
        out_hidden_size=out,
        in_channels=int(config.get("num_channels", 3)),
        gated_mlp=False,
        norm_params=2,
        patch_bias=True,
        **connector,
    )


def _llava(model: dict[str, Any]) -> VisionSpec:
    """LLaVA's CLIP tower (transformers' CLIPVisionConfig) and its projector: LayerNorm blocks
    with a plain MLP (quick GELU), biases on the projections but none on the patch embedding,
    a class token and a learned position for it and each patch of the `image_size` square,
    LayerNorms before the blocks and after them (transformers keeps the last, which LLaVA does
    not read); `LlavaMultiModalProjector`: h -> out -> out, with biases, GELU between. The
    projector reads block `vision_feature_layer` (-2: the last block is never run); its
    strategy 'default' drops the class token: (336 / 14)^2 = 576 tokens per image."""
    config = model["vision_config"]
    hidden, patch = int(config.get("hidden_size", 768)), int(config.get("patch_size", 32))
    image = int(config.get("image_size", 224))
    depth = int(config.get("num_hidden_layers", 12))
    layer = model.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: one layer, as nanoflex runs LLaVA")
    if image % patch:
        raise ValueError(f"image_size {image} is not a whole number of {patch}-pixel patches")
    patches = (image // patch) ** 2
    keep_class = model.get("vision_feature_select_strategy", "default") == "full"
    text = model.get("text_config") or {}
    out = int(text.get("hidden_size", 4096))  # LlamaConfig's default, as llava-1.5's files
    bias = model.get("multimodal_projector_bias", True)
    projector = hidden * out + out * out + (2 * out if bias else 0)
    return VisionSpec(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size", 3072)),
        num_heads=int(config.get("num_attention_heads", 12)),
        patch_size=patch,
        out_hidden_size=out,
        in_channels=int(config.get("num_channels", 3)),
        gated_mlp=False,
        norm_params=2,
        projector_params=2 * 2 * hidden + projector,  # the pre and post LayerNorms
        position_params=(patches + 1) * hidden + hidden,  # and the class token's embedding
        fixed_image_tokens=patches + keep_class,
        unrun_blocks=depth - (layer % (depth + 1)),
    )


READERS: dict[str, Callable[[dict[str, Any]], VisionSpec]] = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl,
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "smolvlm": _idefics3,
    "llava": _llava,
}
"""model_type -> the reader of its tower, given the whole config.json (its `vision_config`,
and what the family keeps beside it); the checkpoint's own type, before the planner reads
its language model."""


def vision_spec(config: dict[str, Any], model_type: str) -> VisionSpec | None:
    """The tower of a config.json whose `model_type` has a reader; None for a text model, or
    a vision checkpoint whose tower the planner does not price yet (its language model alone
    is priced). A missing or bad field raises KeyError, TypeError or ValueError, which the
    caller names."""
    reader = READERS.get(model_type)
    vision = config.get("vision_config")
    if reader is None or not isinstance(vision, dict):
        return None
    return reader(config)
