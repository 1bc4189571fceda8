"""Nemotron-H: each decoder layer is one mixer after an RMSNorm (weights multiplied in
float32), added to the residual stream: a Mamba-2 mixer (a state layer,
`engine.models.mamba2.mamba_mix`), attention without rotary and without an MLP, an MLP of
squared ReLU alone, or (Nemotron 3) a MoE of squared-ReLU experts beside a shared one (both
'dense' layers).

A MoE layer's weights, beside `engine.models.moe`'s router (DeepSeek-V3's grouped sigmoid
routing, `router.correction` its bias) and per-expert tensors:

    experts.<e>.up.weight, experts.<e>.down.weight   each routed expert (no gate)
    shared.up.weight, shared.down.weight             the shared MLP every row runs
    latent_in.weight, latent_out.weight              where `moe_latent_size` is set: the
                                                     experts' input projected to the latent
                                                     and their sum projected back

Checkpoints name the experts one by one (`mixer.experts.<e>.up_proj.weight`) or stacked as
transformers 5 holds them (`mixer.experts.up_proj` (E, I, H), `mixer.experts.down_proj`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.llama import rms_norm_f32
from engine.models.mamba2 import mamba_mix
from engine.models.moe import ExpertSource, GroupedMoeModel, expert_prefix

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
    "mixer.shared_experts.up_proj": "shared.up",
    "mixer.shared_experts.down_proj": "shared.down",
    "mixer.fc1_latent_proj": "latent_in",
    "mixer.fc2_latent_proj": "latent_out",
}
MOE_NAMES = {
    "mixer.gate.weight": "router.weight",
    "mixer.gate.e_score_correction_bias": "router.correction",
    "mixer.experts.up_proj": "experts.up_proj",
    "mixer.experts.down_proj": "experts.down_proj",
}
"""A MoE layer's tensors whose names are not '<module>.<param>' of `LOCAL_NAMES`."""
ROUTER_F32 = frozenset({"router.weight", "router.correction"})
"""A MoE layer's tensors kept in float32 whatever the model computes in."""
EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up|down)_proj\.weight$")


def relu2_mlp(w: Weights, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """down(relu(up(x)) ** 2) over x (T, width), the projections `<prefix>up` and
    `<prefix>down`."""
    return linear(torch.square(F.relu(linear(x, w, f"{prefix}up"))), w, f"{prefix}down")


class NemotronHModel(GroupedMoeModel):
    can_capture = False
    """State layers read and write per-sequence states the graphs do not capture."""
    SUMS_F32 = True
    """transformers' NemotronHExperts adds the experts' weighted rows up in float32."""

    def stored_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The router's weight and correction stay float32 in every dtype, as transformers
        keeps them (`_keep_in_fp32_modules_strict`)."""
        return torch.float32 if name in ROUTER_F32 else dtype

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if hf_name == "backbone.embeddings.weight":
            return 0, "tok.weight"
        if hf_name == "backbone.norm_f.weight":
            return self.num_layers - 1, "norm.weight"
        if hf_name == "lm_head.weight":
            return self.num_layers - 1, "lm_head.weight"
        match = NAME.match(hf_name)
        if match is not None and int(match.group(1)) < self.config.num_layers:
            j, rest = int(match.group(1)) + 1, match.group(2)
            if rest in MOE_NAMES:
                return j, MOE_NAMES[rest]
            expert = EXPERT.match(rest)
            if expert is not None:
                return j, f"{expert_prefix(int(expert.group(1)))}{expert.group(2)}.weight"
        return self.map_decoder_name(hf_name, NAME, LOCAL_NAMES)

    def fuse(self, values: Weights) -> Weights:
        """Stacked up projections split per expert (the down ones: `MoeModel.fuse`)."""
        out = dict(values)
        if "experts.up_proj" in out:
            for e, tensor in enumerate(out.pop("experts.up_proj").unbind(0)):
                out[f"{expert_prefix(e)}up.weight"] = tensor.clone()
        return super().fuse(out)

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
        x = self.input_norm(w, h)
        return h + (self.mlp(w, x) if "router.weight" in w else relu2_mlp(w, x))

    def routed_mlp(self, w: Weights, x: torch.Tensor, source: ExpertSource) -> torch.Tensor:
        """The routed experts (over the latent, where there is one), then the shared MLP over
        the same normed rows x, added."""
        weights, ids = self.route(w, x)
        latent = linear(x, w, "latent_in") if "latent_in.weight" in w else x
        out = self.experts(w, latent, weights, ids, source)
        if "latent_out.weight" in w:
            out = linear(out, w, "latent_out")
        return out + relu2_mlp(w, x, "shared.")

    def expert_mlp(self, w: Weights, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return relu2_mlp(w, x, prefix)

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
