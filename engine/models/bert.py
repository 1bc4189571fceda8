"""BERT-style encoders (BertModel, XLM-RoBERTa) for pooling: the last hidden states of a
padded batch, and the sequence-classification head of a cross-encoder (a reranker's score).

A dense forward in the checkpoint's dtype, equal to transformers' BertModel: embeddings
(word + position + token type, LayerNorm), then per layer bidirectional attention over the
unpadded tokens (SDPA), a LayerNorm after each residual, a GELU MLP. RoBERTa's positions
start after its padding index and count only real tokens. The dense layers run on the real
tokens alone (`BertEncoder.is_packed`): a batch of short and long inputs pays for its
padding only in attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PREFIXES = ("bert.", "roberta.", "model.")
"""What a *ForSequenceClassification checkpoint puts before the encoder's names."""


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a BERT or XLM-RoBERTa config.json that the forward reads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    norm_eps: float
    activation: str
    is_roberta: bool
    pad_token_id: int
    max_positions: int
    num_labels: int

    @staticmethod
    def from_hf(config: Mapping[str, Any]) -> BertConfig:
        architectures = config.get("architectures") or []
        labels = config.get("id2label") or {}
        return BertConfig(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            norm_eps=config.get("layer_norm_eps", 1e-12),
            activation=config.get("hidden_act", "gelu"),
            is_roberta=config.get("model_type") in ("roberta", "xlm-roberta"),
            pad_token_id=config.get("pad_token_id") or 0,
            max_positions=config["max_position_embeddings"],
            num_labels=len(labels) if any("Classification" in a for a in architectures) else 0,
        )


class BertEncoder:
    """An encoder's weights (`weights`: checkpoint names without the task prefix) and its
    forward. `hidden` gives (B, T, H) last hidden states; `classify` a cross-encoder's
    (B, num_labels) logits from its pooler and classifier.

    `is_packed` (the default) runs the dense layers (q/k/v, attention output, MLP,
    LayerNorms) on the real tokens only, packed as (N, H) rows, and pads them back to
    (B, T) for attention alone: a batch's padding costs nothing outside attention. Off, every
    layer runs on all B * T positions (the plain path, as transformers computes it). Both
    attend through SDPA with the padded keys masked out."""

    def __init__(
        self, config: BertConfig, weights: dict[str, torch.Tensor], is_packed: bool = True
    ) -> None:
        self.config = config
        self.weights = weights
        self.is_packed = is_packed
        for j in range(config.num_layers):  # one (3H, H) GEMM a layer instead of three
            name = f"encoder.layer.{j}.attention.self"
            for part in ("weight", "bias"):
                parts = [weights.pop(f"{name}.{p}.{part}") for p in ("query", "key", "value")]
                weights[f"{name}.qkv.{part}"] = torch.cat(parts)

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _layer_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        shape = (self.config.hidden_size,)
        weight, bias = self._w(f"{name}.weight"), self._w(f"{name}.bias")
        return F.layer_norm(x, shape, weight, bias, self.config.norm_eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self._w(f"{name}.weight"), self.weights.get(f"{name}.bias"))

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.activation in ("gelu_new", "gelu_pytorch_tanh"):
            return F.gelu(x, approximate="tanh")
        return F.gelu(x)

    def hidden(
        self, token_ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, T) right-padded token ids and their (B, T) 0/1 mask -> (B, T, H); the rows
        at padded positions hold zeros when packed (pooling never reads them)."""
        c = self.config
        batch, length = token_ids.shape
        if c.is_roberta:  # positions count real tokens from pad_token_id + 1
            positions = torch.cumsum(mask, dim=1) * mask + c.pad_token_id
        else:
            positions = torch.arange(length, device=token_ids.device)[None, :]
        if type_ids is None:
            type_ids = torch.zeros_like(token_ids)
        x = F.embedding(token_ids, self._w("embeddings.word_embeddings.weight"))
        x = x + F.embedding(positions, self._w("embeddings.position_embeddings.weight"))
        if "embeddings.token_type_embeddings.weight" in self.weights:
            x = x + F.embedding(type_ids, self._w("embeddings.token_type_embeddings.weight"))
        x = self._layer_norm(x, "embeddings.LayerNorm").reshape(batch * length, -1)
        keep = mask.bool()[:, None, None, :]  # (B, 1, 1, T): the keys attention may read
        # (N,) flat positions of the real tokens in the (B * T) grid; None: all of them
        where = mask.reshape(-1).nonzero().squeeze(1) if self.is_packed else None
        if where is not None and where.numel() == batch * length:
            where = None  # no padding: the packed rows are the grid itself
        if where is not None:
            x = x.index_select(0, where)
        for j in range(c.num_layers):
            x = self._layer(x, keep, where, f"encoder.layer.{j}")
        if where is None:
            return x.view(batch, length, -1)
        grid = x.new_zeros(batch * length, x.shape[1])
        return grid.index_copy_(0, where, x).view(batch, length, -1)

    def _layer(
        self, x: torch.Tensor, keep: torch.Tensor, where: torch.Tensor | None, name: str
    ) -> torch.Tensor:
        """(N, H) rows -> (N, H) rows; `where` places them in the (B, T) grid of `keep`."""
        c = self.config
        batch, length = keep.shape[0], keep.shape[3]
        head_dim = c.hidden_size // c.num_heads
        qkv = self._linear(x, f"{name}.attention.self.qkv")  # (N, 3H)
        if where is not None:
            qkv = qkv.new_zeros(batch * length, qkv.shape[1]).index_copy_(0, where, qkv)
        # (B * T, 3H) -> 3 x (B, nh, T, hs)
        q, k, v = qkv.view(batch, length, 3, c.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        attended = attended.transpose(1, 2).reshape(batch * length, c.hidden_size)
        if where is not None:
            attended = attended.index_select(0, where)  # (N, H)
        attended = self._linear(attended, f"{name}.attention.output.dense")
        x = self._layer_norm(attended + x, f"{name}.attention.output.LayerNorm")
        inner = self._act(self._linear(x, f"{name}.intermediate.dense"))
        out = self._linear(inner, f"{name}.output.dense")
        return self._layer_norm(out + x, f"{name}.output.LayerNorm")

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) hidden states -> (B, num_labels) logits of the classification head
        (BERT: pooler dense + tanh on the first token, then the classifier; RoBERTa: the
        classifier's dense + tanh, then its out_proj)."""
        first = hidden[:, 0]
        if "classifier.out_proj.weight" in self.weights:
            pooled = torch.tanh(self._linear(first, "classifier.dense"))
            return self._linear(pooled, "classifier.out_proj")
        pooled = torch.tanh(self._linear(first, "pooler.dense"))
        return self._linear(pooled, "classifier")


def encoder_weights(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors by the encoder's names (task prefixes dropped; the heads'
    `classifier.*` kept)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        out[name] = tensor
    return out
