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
        self._state_index = {layer: i for i, layer in enumerate(config.state_layers)}
        """Decoder layer (0-based) -> its index among the state layers."""
        self._mlp_layers = frozenset(config.mlp_layers)
        self._kv_index = {layer: i for i, layer in enumerate(config.kv_layers)}
        """Decoder layer (0-based) -> its index among the layers with KV pages."""

    pooling: str | None = None
    """None: the head gives logits (a generation model). 'embed' or 'score': a decoder pooling
    model's head (engine/executor/pooler.py): the final norm alone, or with a one-row
    classifier `score.weight`; set by the executor before the weights are read."""

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
        """'embed', 'head', 'decoder' (attention over KV pages; Falcon-H1's also mixes through
        a state beside it: `has_state`), 'state' (a hybrid's layer that mixes tokens through
        a fixed-size per-sequence state: `state_layer`) or 'dense' (Nemotron-H's MLP or MoE
        alone: `dense_layer`)."""
        if j == 0:
            return "embed"
        if j == self.num_layers - 1:
            return "head"
        if j - 1 in self._mlp_layers:
            return "dense"
        return "decoder" if j - 1 in self._kv_index else "state"

    def has_state(self, j: int) -> bool:
        """Layer j reads and writes per-sequence states (a 'state' layer, or a Falcon-H1
        'decoder' layer)."""
        return j - 1 in self._state_index

    def state_layer_index(self, j: int) -> int:
        """State layer j's index among the state store's layers."""
        return self._state_index[j - 1]

    def kv_layer(self, j: int) -> int:
        """Attention layer j's index among the KV store's layers (a hybrid's state layers
        have no KV pages)."""
        return self._kv_index[j - 1]

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """One state layer's per-sequence state tensors: name -> (shape, kept in float32;
        else in the compute dtype): the short convolution's last kernel - 1 inputs and the
        recurrent state. Empty for a transformer."""
        c = self.config
        if not c.is_hybrid:
            return {}
        return {
            "conv": ((c.conv_dim, c.linear_conv_kernel - 1), False),
            "recurrent": (c.recurrent_shape, True),
        }

    def dense_layer(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """A decoder layer that is an MLP alone (Nemotron-H): (T, hidden) -> (T, hidden), h +
        MLP(input_norm(h)); a routed one's MLP the block pipeline may run as `block_mlp`
        over the whole block's rows, grouped per expert, and add to h itself."""
        raise NotImplementedError(f"{type(self).__name__} has no MLP-only layers")

    def parallel_output(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor, mixed: torch.Tensor
    ) -> torch.Tensor:
        """The dense ops after attention of a layer whose state mixer ran beside it
        (Falcon-H1): the layer's input states h (T, hidden), the attention output o (T,
        num_heads, head_dim) and the mixer's output `mixed` (T, hidden, from `state_layer`)
        -> the layer's output states (T, hidden)."""
        raise NotImplementedError(f"{type(self).__name__} has no parallel hybrid layers")

    def layer_output(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor, mixed: torch.Tensor | None
    ) -> torch.Tensor:
        """`attention_output`, or `parallel_output` where a state mixer ran beside the
        attention (`mixed` not None)."""
        if mixed is None:
            return self.attention_output(w, h, o)
        return self.parallel_output(w, h, o, mixed)

    def state_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """Decoder state layer j over (T, hidden) rows whose sequences own the rows `spans`
        ((first row, rows) each, in order; the rows after the last span are padding) and the
        states `states` (name -> (B, *shape), one per span, updated in place) -> the layer's
        output states (T, hidden); for a layer that also attends (`parallel_output`), the
        mixer's output alone."""
        raise NotImplementedError(f"{type(self).__name__} has no state layers")

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

    def stored_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a layer's tensor `name` is stored and computed in when the model computes
        in `dtype`: that dtype, unless the family keeps the tensor in float32 (as
        transformers' `_keep_in_fp32_modules_strict`)."""
        return dtype

    def is_compressible(self, j: int, name: str, tensor: torch.Tensor) -> bool:
        """Group-wise 4-bit applies to the dense matrices of decoder layers and the LM head."""
        kind = self.layer_kind(j)
        return tensor.dim() == 2 and kind != "embed" and not (kind == "head" and self.pooling)

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
    """oneDNN prepacks linear weights for the CPU, in float32, and in bfloat16 where the CPU
    has the instructions its bfloat16 GEMM needs (AVX512-BW/VL/DQ or AVX-NE-CONVERT: oneDNN
    refuses the reorder elsewhere, e.g. on an AVX2-only EPYC, and `F.linear` runs instead)."""
    if device.type != "cpu" or dtype not in PREPACK_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU linear layer's (out, in) weight reordered once, at load, into oneDNN's blocked
    layout for this CPU (IPEX and vLLM's CPU backend do the same). `F.linear` runs the same
    kind of GEMM but reorders the weight on every call: at a decode step's few rows that
    reorder costs as much as the product (measured 1.7-2.2x in bfloat16 and 1.2-1.3x in
    float32 on 64 rows, docs/benchmarks.md). `linear` takes the packed tensor as it is; it
    holds the same values and supports nothing but `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)
