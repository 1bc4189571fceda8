"""gpt-oss: the Llama layer with q/k/v/o biases, per-head attention sinks, sliding-window and
full layers alternating, YaRN, RMSNorms scaling in float32, and a mixture of experts of its
own:

- router: logits with a bias; the top-k logits, softmaxed among themselves (in the model's
  dtype), weigh the experts;
- experts: gate_up with a bias, gate and up interleaved column by column in the checkpoint
  (stacked (experts, hidden, 2 * width), applied as x @ W); the clamped SwiGLU
  (up.clamp(-limit, limit) + 1) * gate * sigmoid(alpha * gate) with gate clamped above at
  limit; down with a bias.

`fuse` splits the stacked experts into each expert's (out, in) matrices and biases, the gate
rows first and the up rows after (so one GEMM gives both, as every other family's gate_up),
and the sinks travel with the layer's weights to `Model.attention_spec`, which every
attention path honours through the eager product (engine/executor/attention.py: sdpa).
"""

from __future__ import annotations

import torch

from engine.models.base import Weights, linear
from engine.models.llama import rms_norm_f32
from engine.models.moe import MoeModel, expert_prefix

STACKED = {
    "gate_up_proj": "gate_up.weight",
    "gate_up_proj_bias": "gate_up.bias",
    "down_proj": "down.weight",
    "down_proj_bias": "down.bias",
}
"""`mlp.experts.<name>` stacked over experts -> each expert's local name."""


class GptOssModel(MoeModel):
    ROUTER_WEIGHTS_F32 = False

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        name = hf_name.removeprefix("model.")
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers":
            j = int(parts[1]) + 1
            if int(parts[1]) >= self.config.num_layers:
                return None
            rest = ".".join(parts[2:])
            if rest == "self_attn.sinks":
                return j, "sinks"
            if rest in ("mlp.router.weight", "mlp.router.bias"):
                return j, f"router.{parts[-1]}"
            if rest.startswith("mlp.experts.") and parts[-1] in STACKED:
                return j, f"experts.{parts[-1]}"
        return super().map_name(hf_name)

    def fuse(self, values: Weights) -> Weights:
        """Stacked experts -> per expert: gate_up (2 * width, hidden) with the gate rows first,
        its bias likewise, down (hidden, width) and its bias, each its own storage."""
        out = dict(values)
        for stacked, local in STACKED.items():
            tensor = out.pop(f"experts.{stacked}", None)
            if tensor is None:
                continue
            for e, t in enumerate(tensor.unbind(0)):
                if stacked.startswith("gate_up"):  # columns gate, up, gate, up, ...
                    t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
                if t.dim() == 2:  # applied as x @ W: stored (in, out)
                    t = t.t()
                out[f"{expert_prefix(e)}{local}"] = t.contiguous().clone()
        return super().fuse(out)

    def is_compressible(self, j: int, name: str, tensor: torch.Tensor) -> bool:
        return name != "sinks" and super().is_compressible(j, name, tensor)

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return rms_norm_f32(x, w[f"{name}.weight"], self.config.norm_eps)

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, w, "ln1")

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + linear(o.reshape(o.shape[0], -1), w, "o")
        return h, self._norm(h, w, "ln2")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(self._norm(h, w, "norm"), w, "lm_head").float()

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k router logits (with the router's bias), softmaxed among themselves."""
        top, ids = torch.topk(linear(x, w, "router"), self.config.num_experts_per_tok, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids

    def expert_mlp(self, w: Weights, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """down(clamped SwiGLU(gate_up(x))), biases included."""
        c = self.config
        gate, up = linear(x, w, f"{prefix}gate_up").chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=c.swiglu_limit)
        up = up.clamp(min=-c.swiglu_limit, max=c.swiglu_limit)
        glu = gate * torch.sigmoid(gate * c.swiglu_alpha)
        return linear((up + 1) * glu, w, f"{prefix}down")
