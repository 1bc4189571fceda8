"""`ImageRows`: which token rows of a GPU batch take image features instead of their
embeddings, and their M-RoPE positions (engine/core/media.py); `embed_images` and
`add_deepstack`: the features put in place of the embeddings and added to the first decoder
layers' outputs (Qwen3-VL's DeepStack)."""

from __future__ import annotations

import torch

from engine.core.media import SeqMedia


def mrope_rows(media: SeqMedia | None, start: int, count: int) -> list[int]:
    """The (t, h, w) positions of a sequence's tokens [start, start + count), flat: three
    per row; without media, each token's position on all three axes."""
    if media is None:
        return [p for p in range(start, start + count) for _ in range(3)]
    return [axis for p in range(start, start + count) for axis in media.position(p)]


class ImageRows:
    """The image rows of one GPU batch, gathered chunk by chunk while it is staged."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.pieces: list[torch.Tensor] = []

    def add(
        self,
        media: SeqMedia,
        features: list[torch.Tensor],
        start: int,
        count: int,
        row: int,
    ) -> None:
        """A chunk of tokens [start, start + count) of a sequence with `media` (each image's
        (num_tokens, hidden) `features`), its first token at batch row `row`."""
        for image, feats in zip(media.images, features, strict=True):
            for index, feature, length in image.feature_spans(start, start + count):
                self.rows.extend(range(row + index - start, row + index - start + length))
                self.pieces.append(feats[feature : feature + length])

    def features(self, device: torch.device) -> torch.Tensor:
        """(R, hidden) features of the rows, in order, on `device` (the batch has some:
        `rows`): a tower homed on the host hands host features, gathered there and copied
        to the compute device in one piece."""
        return torch.cat(self.pieces).to(device)


def embed_images(h: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The (T, hidden) embeddings `h`, the image rows' replaced in place by their features'
    first `hidden` columns (in place: a replayed embedding's output is its graphs' static
    buffer, which the next layer reads); `images`: (rows (R,), features (R, hidden * (1 +
    deepstack layers)))."""
    rows, features = images
    return h.index_copy_(0, rows, features[:, : h.shape[1]].to(h.dtype))


def add_deepstack(
    layer: int, h: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """Decoder layer `layer`'s (0-based) (T, hidden) output with its DeepStack features added
    at the image rows, where the features carry that layer's columns (Qwen3-VL: the columns
    [hidden * (1 + layer), hidden * (2 + layer))); else `h` itself."""
    if images is None:
        return h
    rows, features = images
    hidden = h.shape[1]
    start = hidden * (1 + layer)
    if features.shape[1] < start + hidden:
        return h
    return h.index_add(0, rows, features[:, start : start + hidden].to(h.dtype))
