"""`Model`: the layer-wise contract every architecture implements (embed, decoder layers, head).

The engine sees a model as a flat list of layers, FlexGen-style: layer 0 is the
input embedding, layers 1..L are decoder layers, layer L+1 is the output head.
Each layer's weights are a flat dict of named tensors so they can be placed,
moved and compressed independently of the math.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.kernels import DenseOps
from engine.models.config import ModelConfig

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Positions:
    """Absolute positions of a batch's token rows and what the model derives from them (rotary
    cos and sin tables), computed once per step and read by every layer."""

    ids: torch.Tensor
    """(T,) absolute positions."""
    tables: tuple[torch.Tensor, ...] = ()
    """Per-row tables, each (T, ...); the model's own (`Model.positions`)."""

    def __getitem__(self, rows: slice) -> Positions:
        """The positions of a contiguous run of rows (a nano-batch's): views, no copies."""
        return Positions(self.ids[rows], tuple(t[rows] for t in self.tables))

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """How one decoder layer's attention scores its keys, beyond causality
    (`Model.attention_spec`)."""

    window: int = 0
    """Sliding window: a query sees its last `window` keys, itself included; 0: all."""
    scale: float | None = None
    """Scores = q.k * scale; None: head_dim ** -0.5 (SDPA's default)."""
    softcap: float = 0.0
    """Scores become softcap * tanh(scores / softcap) before the mask (Gemma 2); 0: none."""
    sinks: torch.Tensor | None = None
    """(num_heads,) gpt-oss's sink logits: each head's softmax has one more column with this
    score and no value (the probabilities of the keys sum to less than 1); None: none."""


class Model(ABC):
    """Stateless math over one layer at a time; weights and KV come from the caller."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.dense_ops: DenseOps | None = None
        """Fused CPU ops for the work around the GEMMs (`engine.kernels`), set where the
        model computes on a CPU with native kernels on; None: torch's own ops."""

    can_capture = True
    """The ops around attention run the same kernels on the same shapes every step at a given
    row count, so CUDA graphs may capture them (`engine/executor/cuda_graphs.py`)."""

    @property
    def num_layers(self) -> int:
        """Embedding + decoder layers + head."""
        return self.config.num_layers + 2

    def attention_spec(self, j: int, w: Weights) -> AttentionSpec:
        """Decoder layer j's window, score scale and soft-capping (from the config), and its
        sink logits (from its weights `w`, gpt-oss)."""
        c = self.config
        return AttentionSpec(c.window(j - 1), c.attn_scale, c.attn_softcap, w.get("sinks"))

    def layer_kind(self, j: int) -> str:
        if j == 0:
            return "embed"
        return "head" if j == self.num_layers - 1 else "decoder"

    @abstractmethod
    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        """Checkpoint tensor name -> (layer index j, local name), or None to skip it."""

    def tied_head_source(self) -> tuple[int, str, str]:
        """(layer, local name) of the token embedding and the head's local name when tied."""
        return 0, "tok.weight", "lm_head.weight"

    def map_decoder_name(
        self, name: str, pattern: re.Pattern[str], local_names: dict[str, str]
    ) -> tuple[int, str] | None:
        """'<prefix>.<i>.<module>.<param>' matched by `pattern` (groups: i, module.param)
        -> (decoder layer i + 1, '<local>.<param>'), or None for a module we do not use."""
        match = pattern.match(name)
        if match is None or int(match.group(1)) >= self.config.num_layers:
            return None  # not a decoder layer's, or a multi-token prediction layer's (DeepSeek)
        module, _, param = match.group(2).rpartition(".")
        local = local_names.get(module)
        return None if local is None else (int(match.group(1)) + 1, f"{local}.{param}")

    def fuse(self, values: Weights) -> Weights:
        """One layer's weights as read from the checkpoint -> as the layer's math reads them:
        projections that share an input concatenated along the output dimension, so each
        runs as one GEMM (`FUSED`). Runs once at load, before compression and placement."""
        out = dict(values)
        for fused, parts in FUSED.items():
            for param in ("weight", "bias"):
                first = f"{parts[0]}.{param}"
                # each module's own projections: '<prefix>gate.weight' with '' or an expert's
                # 'experts.3.' as prefix
                prefixes = [n[: -len(first)] for n in out if n.endswith(first)]
                for prefix in prefixes:
                    names = [f"{prefix}{part}.{param}" for part in parts]
                    if (not prefix or prefix.endswith(".")) and all(n in out for n in names):
                        out[f"{prefix}{fused}.{param}"] = torch.cat([out.pop(n) for n in names])
        return out

    def positions(self, ids: torch.Tensor, dtype: torch.dtype) -> Positions:
        """(T,) positions -> `Positions` with the tables every layer of a step reads."""
        return Positions(ids)

    @abstractmethod
    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids at (T,) positions -> (T, hidden) states."""

    @abstractmethod
    def attention_inputs(
        self, j: int, w: Weights, h: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense ops before decoder layer j's attention (norm, QKV projection, rotary):
        (T, hidden) states -> q (T, num_heads, head_dim), k and v (T, num_kv_heads,
        head_dim)."""

    @abstractmethod
    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The dense ops after attention (output projection, residuals, norms, MLP): the
        layer's input states h (T, hidden) and attention output o (T, num_heads, head_dim)
        -> the layer's output states (T, hidden)."""

    @abstractmethod
    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """(S, hidden) states -> (S, vocab) float32 logits."""

    def is_compressible(self, j: int, name: str, tensor: torch.Tensor) -> bool:
        """Group-wise 4-bit applies to the dense matrices of decoder layers and the LM head."""
        return tensor.dim() == 2 and self.layer_kind(j) != "embed"

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, (heads + 2 * kv_heads) * head_dim), the fused projection's output -> per-head
        views q (T, heads, head_dim), k and v (T, kv_heads, head_dim)."""
        c = self.config
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.kv_dim, c.kv_dim], dim=-1)
        return (
            q.view(-1, c.num_heads, c.head_dim),
            k.view(-1, c.num_kv_heads, c.head_dim),
            v.view(-1, c.num_kv_heads, c.head_dim),
        )


FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
"""Fused projection -> the checkpoint's projections it concatenates, in order."""


def linear(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    """x @ W.T (+ b) with W = w[name + '.weight'] and optional w[name + '.bias']; W may be
    prepacked (`prepack`)."""
    weight, bias = w[f"{name}.weight"], w.get(f"{name}.bias")
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacks linear weights for the CPU, in float32 and bfloat16."""
    return device.type == "cpu" and dtype in PREPACK_DTYPES and torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU linear layer's (out, in) weight reordered once, at load, into oneDNN's blocked
    layout for this CPU (IPEX and vLLM's CPU backend do the same). `F.linear` runs the same
    kind of GEMM but reorders the weight on every call: at a decode step's few rows that
    reorder costs as much as the product (measured 1.7-2.2x in bfloat16 and 1.2-1.3x in
    float32 on 64 rows, docs/benchmarks.md). `linear` takes the packed tensor as it is; it
    holds the same values and supports nothing but `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)
