"""Qwen2.5-VL's language model: Qwen2's layer with M-RoPE, each token rotated by a (t, h, w)
position whose axes own consecutive sections of the rotary frequencies (`mrope_section`).
Text tokens have three equal coordinates, so on text alone it is Qwen2; an image's tokens get
their grid coordinates (engine/core/media.py). The vision tower is its own module
(engine/models/qwen2_5_vision.py), run by the executor's vision encoder."""

from __future__ import annotations

import torch

from engine.models.base import Positions
from engine.models.config import ModelConfig
from engine.models.llama import LlamaModel
from engine.models.qwen2_5_vision import vision_weight_name


class Qwen25VLModel(LlamaModel):
    can_capture = False
    """Its positions are (T, 3) rows, which the decode graphs do not stage."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._axes = self.rotary_axes(config.mrope_section)
        """(rotary_dim/2,) the position axis (0 t, 1 h, 2 w) each frequency reads."""
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def rotary_axes(section: tuple[int, ...]) -> torch.Tensor:
        """(rotary_dim/2,) the axis of each frequency: the sections in turn, t's first."""
        return torch.tensor([i % 3 for i, n in enumerate(section) for _ in range(n)])

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if vision_weight_name(hf_name) is not None:
            return None  # the vision tower's: loaded by the vision encoder
        # transformers 5 names the language model model.language_model.*, 4 model.*
        return super().map_name(hf_name.replace("model.language_model.", "model.", 1))

    def positions(self, ids: torch.Tensor, dtype: torch.dtype) -> Positions:
        """(T, 3) M-RoPE positions, or (T,) where each token's three are equal -> cos and sin
        (T, 1, head_dim), each frequency rotated by its section's axis."""
        inv_freq, axes = self._on_device.get(ids.device) or self._copy_to(ids.device)
        rows = ids if ids.dim() == 2 else ids[:, None].expand(-1, 3)
        angles = rows.float()[:, :, None] * inv_freq  # (T, 3, rotary_dim/2)
        picked = angles.gather(1, axes.expand(rows.shape[0], 1, -1)).squeeze(1)
        emb = torch.cat((picked, picked), dim=-1)[:, None, :]  # (T, 1, rotary_dim)
        return Positions(ids, (emb.cos().to(dtype), emb.sin().to(dtype)))

    def _copy_to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The frequencies and their axes on `device`, copied once."""
        kept = (self._ropes[0].inv_freq.to(device), self._axes.to(device)[None, None, :])
        self._on_device[device] = kept
        return kept
