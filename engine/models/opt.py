"""OPT: learned positions (offset 2), LayerNorm before or after, ReLU MLP, biases everywhere."""

from __future__ import annotations

import re

import torch

from engine.models.base import Model, Positions, Weights, linear

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LOCAL = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.out_proj": "o",
    "self_attn_layer_norm": "ln1",
    "fc1": "fc1",
    "fc2": "fc2",
    "final_layer_norm": "ln2",
}
_POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows


class OPTModel(Model):
    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if hf_name == "lm_head.weight":
            return self.num_layers - 1, "lm_head.weight"
        name = hf_name.removeprefix("model.").removeprefix("decoder.")
        embed = {"embed_tokens.weight": "tok.weight", "embed_positions.weight": "pos.weight"}
        if name in embed:
            return 0, embed[name]
        if name == "project_in.weight":
            return 0, "project_in.weight"
        if name.startswith("final_layer_norm."):
            if not self.config.do_layer_norm_before:
                return None  # post-norm OPT (350m) has no final norm in its forward pass
            return self.num_layers - 1, "norm." + name.rpartition(".")[2]
        if name == "project_out.weight":
            return self.num_layers - 1, "project_out.weight"
        return self.map_decoder_name(name, _LAYER, _LOCAL)

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(token_ids, w["tok.weight"])
        if "project_in.weight" in w:
            x = linear(x, w, "project_in")
        return x + torch.nn.functional.embedding(positions + _POSITION_OFFSET, w["pos.weight"])

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(
            x, (x.shape[-1],), w[f"{name}.weight"], w.get(f"{name}.bias"), self.config.norm_eps
        )

    def attention_inputs(
        self, j: int, w: Weights, h: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self._norm(h, w, "ln1") if self.config.do_layer_norm_before else h
        return self.split_qkv(linear(x, w, "qkv"))

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        pre = self.config.do_layer_norm_before
        h = h + linear(o.reshape(o.shape[0], -1), w, "o")
        if not pre:
            h = self._norm(h, w, "ln1")
        x = self._norm(h, w, "ln2") if pre else h
        x = linear(torch.relu(linear(x, w, "fc1")), w, "fc2")
        h = h + x
        return h if pre else self._norm(h, w, "ln2")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        if "norm.weight" in w:
            h = self._norm(h, w, "norm")
        if "project_out.weight" in w:
            h = linear(h, w, "project_out")
        return linear(h, w, "lm_head").float()
