"""Qwen3-VL's language model: Qwen3's layer (q and k normed per head) with Qwen2.5-VL's M-RoPE
(engine/models/qwen2_5_vl.py), its frequencies' axes interleaved (t, h, w, t, h, w, ...) rather
than in consecutive sections. The vision tower is its own module (engine/models/
qwen3_vision.py), run by the executor's vision encoder; its DeepStack features are added to the
first decoder layers' outputs by the executor (engine/executor/image_rows.py)."""

from __future__ import annotations

import torch

from engine.models.qwen2_5_vl import Qwen25VLModel
from engine.models.qwen3 import Qwen3Model


class Qwen3VLModel(Qwen25VLModel, Qwen3Model):
    @staticmethod
    def rotary_axes(section: tuple[int, ...]) -> torch.Tensor:
        """(rotary_dim/2,) the axis of each frequency: frequency i reads h where i % 3 == 1
        and i < 3 * section[1], w where i % 3 == 2 and i < 3 * section[2], else t
        (transformers' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`)."""
        axes = [0] * sum(section)
        for axis in (1, 2):
            for i in range(axis, min(3 * section[axis], len(axes)), 3):
                axes[i] = axis
        return torch.tensor(axes)
