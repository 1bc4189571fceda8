"""Qwen3-VL's language model (and Qwen3-VL-MoE's): Qwen3's layer (q and k normed per head)
with Qwen2.5-VL's M-RoPE (engine/models/qwen2_5_vl.py), its frequencies' axes interleaved
(t, h, w, t, h, w, ...) rather than in consecutive sections. The vision tower is its own
module (engine/models/qwen3_vision.py), run by the executor's vision encoder; its DeepStack
features are added to the first decoder layers' outputs by the executor
(engine/executor/image_rows.py)."""

from __future__ import annotations

import torch

from engine.models.base import Weights
from engine.models.moe import STACKED, MoeModel
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


class Qwen3VLMoeModel(MoeModel, Qwen3VLModel):
    """Qwen3-VL-MoE: Qwen3-VL's layer whose MLP is Qwen3-MoE's. The published checkpoints
    stack the experts transposed, gate_up_proj (E, hidden, 2I) and down_proj (E, I, hidden),
    which transformers transposes at load where the shape is not its own (E, 2I, hidden) and
    (E, hidden, I) (a checkpoint it saved is in its own); so does `fuse`."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        return super().map_name(hf_name.replace("model.language_model.", "model.", 1))

    def fuse(self, values: Weights) -> Weights:
        c = self.config
        own = {
            "experts.gate_up_proj": (2 * c.moe_intermediate_size, c.hidden_size),
            "experts.down_proj": (c.hidden_size, c.moe_intermediate_size),
        }
        stacked = {
            name: tensor.transpose(1, 2)
            for name, tensor in values.items()
            if name in STACKED and tuple(tensor.shape[1:]) != own[name]
        }
        return super().fuse({**values, **stacked})
