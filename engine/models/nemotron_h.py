"""Nemotron-H: each decoder layer is one mixer after an RMSNorm (weights multiplied in
float32), added to the residual stream: a Mamba-2 mixer (a state layer,
`engine.models.mamba2.mamba_mix`), attention without rotary and without an MLP, or an MLP of
squared ReLU alone (a 'dense' layer)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.llama import LlamaModel, rms_norm_f32
from engine.models.mamba2 import mamba_mix

NAME = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")
LOCAL_NAMES = {
    "norm": "ln1",
    "mixer.q_proj": "q",
    "mixer.k_proj": "k",
    "mixer.v_proj": "v",
    "mixer.o_proj": "o",
    "mixer.up_proj": "up",
    "mixer.down_proj": "down",
    "mixer.in_proj": "m_in",
    "mixer.conv1d": "conv",
    "mixer": "ssm",
    "mixer.norm": "ssm_norm",
    "mixer.out_proj": "ssm_out",
}


class NemotronHModel(LlamaModel):
    can_capture = False
    """State layers read and write per-sequence states the graphs do not capture."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if hf_name == "backbone.embeddings.weight":
            return 0, "tok.weight"
        if hf_name == "backbone.norm_f.weight":
            return self.num_layers - 1, "norm.weight"
        if hf_name == "lm_head.weight":
            return self.num_layers - 1, "lm_head.weight"
        return self.map_decoder_name(hf_name, NAME, LOCAL_NAMES)

    def _norm(self, h: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return rms_norm_f32(h, w[f"{name}.weight"], self.config.norm_eps)

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, w, "ln1")

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return h + linear(o.reshape(o.shape[0], -1), w, "o")

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a Nemotron-H attention layer has no MLP")

    def dense_layer(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        up = linear(self.input_norm(w, h), w, "up")
        return h + linear(torch.square(F.relu(up)), w, "down")

    def state_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        return h + mamba_mix(self.config, w, self.input_norm(w, h), states, spans)

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(self._norm(h, w, "norm"), w, "lm_head").float()
