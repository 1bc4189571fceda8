"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5): the Llama layer
whose MLP routes each token to its top-k experts, computed as one GEMM pair per expert over all
the rows routed to it.

A MoE layer's `Weights` hold the router and each routed expert as its own tensors, so that an
expert can be placed, moved and compressed alone:

    router.weight               (num_experts, hidden)      kept in full precision
    experts.<e>.gate_up.weight  (2 * moe_intermediate, hidden), gate rows then up rows
    experts.<e>.down.weight     (hidden, moe_intermediate)
    router.correction           (num_experts,) DeepSeek-V3's and GLM-4.5's load-balancing bias
    shared.gate_up.weight       the shared expert(s), every token through them (Qwen2-MoE's
    shared.down.weight          shared_expert; DeepSeek's and GLM's shared_experts, as one)
    shared_gate.weight          (1, hidden), Qwen2-MoE's sigmoid gate, in full precision
    router.picks                (num_experts,) int64 in host memory, when the weight store
                                counts: each batch adds the rows routed to each expert

Checkpoints name experts one by one (`mlp.experts.<e>.gate_proj`, Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2`) or stacked as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)); `fuse` makes both
the layout above. A layer without a router (Qwen's `mlp_only_layers`) has the dense MLP.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch

from engine.models.base import Weights, linear
from engine.models.llama import LAYER_NAME, LlamaModel, swiglu
from engine.models.qwen3 import Qwen3Model

MOE_MODULE = re.compile(r"^(?:mlp|block_sparse_moe)\.(.+)$")
"""A decoder layer's MLP tensor (module.param after the layer prefix): group 1, the rest."""
EXPERT_TENSOR = re.compile(r"^(experts\.\d+|shared_experts?)\.(\w+)\.weight$")
"""One expert's projection: groups (expert module, projection)."""
EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",  # Mixtral's names
    "w3": "up",
    "w2": "down",
}
MOE_TENSORS = {
    "gate.weight": "router.weight",
    "gate.e_score_correction_bias": "router.correction",
    "shared_expert_gate.weight": "shared_gate.weight",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
}
"""The MLP's other tensors -> local names (the last two stacked over experts, split by `fuse`)."""
STACKED = {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}
"""Stacked (E, out, in) tensors -> each expert's projection."""
PICKS = "router.picks"
"""The counter of routed rows per expert that travels with a MoE layer's weights, when the
weight store keeps one (engine/storage/expert_picks.py)."""
FULL_PRECISION = frozenset({"router.weight", "router.correction", "shared_gate.weight"})
"""Routing weights never compressed: a 4-bit error flips which experts a token picks, and
they are a few rows beside each expert's matrices."""


def expert_prefix(e: int) -> str:
    """Expert e's tensors are named `<prefix>gate_up.weight` and `<prefix>down.weight`."""
    return f"experts.{e}."


def moe_local_name(module_param: str) -> str | None:
    """A decoder layer's 'module.param' -> its local MoE name, or None if not a MoE tensor."""
    match = MOE_MODULE.match(module_param)
    if match is None:
        return None
    rest = match.group(1)
    if rest in MOE_TENSORS:
        return MOE_TENSORS[rest]
    expert = EXPERT_TENSOR.match(rest)
    if expert is None or expert.group(2) not in EXPERT_PROJECTIONS:
        return None
    module = "shared" if expert.group(1).startswith("shared_expert") else expert.group(1)
    return f"{module}.{EXPERT_PROJECTIONS[expert.group(2)]}.weight"


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, num_experts) -> (weights, expert ids), each (T, top_k) in
    `torch.topk`'s order (largest first; ties as topk breaks them): softmax in float32, the
    top k, renormalised to sum to 1 if asked. Weights stay float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(
    logits: torch.Tensor,
    correction: torch.Tensor,
    top_k: int,
    num_groups: int,
    groups_per_tok: int,
    renormalise: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's and GLM-4.5's router: float32 logits (T, num_experts) -> (weights, expert
    ids), each (T, top_k). Scores are sigmoids; experts are chosen by score + `correction`
    (the load-balancing bias, (num_experts,)) among the `groups_per_tok` groups of experts
    whose two best corrected scores sum highest; weights are the uncorrected scores,
    renormalised if asked (+ 1e-20), times `scale` (routed_scaling_factor). The same torch
    calls in the same order as transformers', `sorted=False` top-k included, so ids and
    weights agree bit for bit on the same device."""
    scores = logits.sigmoid()
    choice = scores + correction
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, num_groups)
    group_ids = torch.topk(group_scores, k=groups_per_tok, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


ExpertFn = Callable[[Weights, torch.Tensor], torch.Tensor]
"""One expert's computation: (its weights, its rows) -> its output rows."""


class ExpertSource(Protocol):
    """Where a MoE layer's routed experts run and get their weights: with the layer's own
    (every expert loaded with it), or as engine/executor/moe_block.py decides once the rows
    are routed (loaded then, or run on the CPU where they lie)."""

    def start(self, active: dict[int, int]) -> None:
        """The experts with rows (expert -> rows), in the order they will run."""

    def run(self, e: int, x: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
        """Expert e's output rows for its rows x."""
        ...


class _WithLayer:
    """The experts loaded with the layer's weights, run where the layer runs."""

    def __init__(self, w: Weights) -> None:
        self.w = w

    def start(self, active: dict[int, int]) -> None:
        pass

    def run(self, e: int, x: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
        return fn(self.w, x)


class MoeModel(LlamaModel):
    """Qwen2-MoE, and the base of the other families: router weights cast to the model's dtype
    before they scale the experts' outputs."""

    ROUTER_WEIGHTS_F32 = False
    """Mixtral scales the experts' outputs by float32 router weights (then casts back)."""
    SCALES_INPUTS = False
    """Llama 4 scales each row's input to its expert by the router weight, not its output."""
    SUMS_F32 = False
    """Nemotron-H adds the experts' weighted rows up in float32 and casts the sum back (the
    others cast each expert's weighted rows back to the model's dtype before adding them)."""
    can_capture = False
    """The routing decides each step which experts run over how many rows (read back to the
    host), which a CUDA graph cannot replay."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        match = LAYER_NAME.match(hf_name.removeprefix("model."))
        local = None if match is None else moe_local_name(match.group(2))
        if match is not None and int(match.group(1)) >= self.config.num_layers:
            return None  # the multi-token prediction layer after the last (DeepSeek, GLM)
        if match is not None and local is not None:
            return int(match.group(1)) + 1, local
        return super().map_name(hf_name)

    def fuse(self, values: Weights) -> Weights:
        """Stacked experts split into one tensor set per expert (each its own storage), then
        every gate and up projection fused (`Model.fuse`)."""
        out = dict(values)
        for stacked, projection in STACKED.items():
            if stacked in out:
                for e, tensor in enumerate(out.pop(stacked).unbind(0)):
                    out[f"{expert_prefix(e)}{projection}.weight"] = tensor.clone()
        return super().fuse(out)

    def is_compressible(self, j: int, name: str, tensor: torch.Tensor) -> bool:
        return name not in FULL_PRECISION and super().is_compressible(j, name, tensor)

    def mlp(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        if "router.weight" not in w:
            return super().mlp(w, x)  # a dense layer
        return self.routed_mlp(w, x, _WithLayer(w))

    def block_mlp(
        self, w: Weights, xs: list[torch.Tensor], source: ExpertSource
    ) -> list[torch.Tensor]:
        """The MoE MLP over several GPU batches' normed rows at once, grouped per expert
        (each expert runs once for the block, as `source` says)."""
        out = self.routed_mlp(w, torch.cat(xs) if len(xs) > 1 else xs[0], source)
        return list(out.split([x.shape[0] for x in xs]))

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed rows x (T, hidden) -> (weights, expert ids), each (T, top_k): softmax top-k."""
        c = self.config
        return route(linear(x, w, "router"), c.num_experts_per_tok, c.norm_topk_prob)

    def routed_mlp(self, w: Weights, x: torch.Tensor, source: ExpertSource) -> torch.Tensor:
        weights, ids = self.route(w, x)
        if not self.ROUTER_WEIGHTS_F32:
            weights = weights.to(x.dtype)
        out = self.experts(w, x, weights, ids, source)
        if "shared.gate_up.weight" in w:  # the shared expert(s), every row through them
            shared = swiglu(self.ops, w, x, "shared.")
            if "shared_gate.weight" in w:  # Qwen2-MoE's sigmoid gate
                shared = torch.sigmoid(linear(x, w, "shared_gate")) * shared
            out = out + shared
        return out

    def expert_mlp(self, w: Weights, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """One routed expert over its rows x: the SwiGLU named `<prefix>gate_up`, `<prefix>down`."""
        return swiglu(self.ops, w, x, prefix)

    def experts(
        self,
        w: Weights,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        source: ExpertSource,
    ) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x) (or expert(weight * x), with
        `SCALES_INPUTS`), (T, hidden). The T * k
        (token, expert) pairs are sorted by expert, so each expert with tokens runs once, as
        one GEMM pair over all its rows; the results scaled and added back per token, in
        expert order (as transformers adds them), in the model's dtype or, with `SUMS_F32`,
        in float32. `source`: where each expert runs and gets its weights."""
        num_slots = ids.shape[1]
        flat = ids.flatten()  # (T * k,) the expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order
        rows = order // num_slots  # (T * k,) each grouped slot's token row
        per_expert = torch.bincount(flat, minlength=self.config.num_experts)
        picks = w.get(PICKS)
        if picks is not None:  # the router's counts, for placing the most-picked experts
            picks += per_expert.to(picks.device)
        counts = per_expert.tolist()
        source.start({e: count for e, count in enumerate(counts) if count})
        slot_weights = weights.flatten()[order, None]  # (T * k, 1) in the grouped order
        grouped = x[rows]  # (T * k, hidden)
        if self.SCALES_INPUTS:
            grouped = grouped * slot_weights
        out = torch.empty_like(grouped)
        start = 0
        for e, count in enumerate(counts):
            if count:
                end = start + count
                prefix = expert_prefix(e)

                def expert(w: Weights, rows: torch.Tensor, prefix: str = prefix) -> torch.Tensor:
                    return self.expert_mlp(w, rows, prefix)

                out[start:end] = source.run(e, grouped[start:end], expert)
                start = end
        scaled = out if self.SCALES_INPUTS else out * slot_weights  # float32 if the weights are
        sum_dtype = torch.float32 if self.SUMS_F32 else x.dtype
        sums = torch.zeros_like(x, dtype=sum_dtype).index_add_(0, rows, scaled.to(sum_dtype))
        return sums.to(x.dtype)


class MixtralModel(MoeModel):
    """Mixtral: top-2 of 8 experts, always renormalised (the config reader says so)."""

    ROUTER_WEIGHTS_F32 = True


class Qwen3MoeModel(MoeModel, Qwen3Model):
    """Qwen3-MoE: Qwen 3's per-head q/k norms, many small experts."""


class OlmoeModel(MoeModel, Qwen3Model):
    """OLMoE: RMSNorms over the whole q and k projections, Llama-style (cast, then scale).
    Qwen 3's `norm_qk` reads each norm's width from its weight, which here spans all heads."""


class GroupedMoeModel(MoeModel):
    """DeepSeek-V3's and GLM-4.5's MoE layer: sigmoid scores with a load-balancing correction,
    top-k within the best groups of experts (`route_grouped`), float32 weights scaled by
    routed_scaling_factor, and shared experts (one SwiGLU as wide as all of them) every row
    runs, added without a gate. The router runs in float32, as transformers keeps it."""

    ROUTER_WEIGHTS_F32 = True

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = torch.nn.functional.linear(x.float(), w["router.weight"].float())
        return route_grouped(
            logits,
            w["router.correction"].float(),
            c.num_experts_per_tok,
            c.num_expert_groups,
            c.num_groups_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )


class Glm4MoeModel(GroupedMoeModel, Qwen3Model):
    """GLM-4.5/4.6: the grouped-routing MoE layer (dense first layers) under a Llama attention
    with q/k/v biases, partial rotary (half of each head) and, where use_qk_norm says, Qwen 3's
    per-head q/k norms."""

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        return super().norm_qk(w, qkv) if "q_norm.weight" in w else qkv
