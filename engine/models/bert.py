"""BERT-style encoders (BertModel, XLM-RoBERTa) for pooling: the last hidden states of a
padded batch, and the sequence-classification head of a cross-encoder (a reranker's score).

A plain dense forward in the checkpoint's dtype, as transformers' eager BertModel computes
it: embeddings (word + position + token type, LayerNorm), then per layer bidirectional
attention over the unpadded tokens, a LayerNorm after each residual, a GELU MLP. RoBERTa's
positions start after its padding index and count only real tokens.
"""

from __future__ import annotations

import math
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
    (B, num_labels) logits from its pooler and classifier."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = weights

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
        """(B, T) right-padded token ids and their (B, T) 0/1 mask -> (B, T, H)."""
        c = self.config
        if c.is_roberta:  # positions count real tokens from pad_token_id + 1
            positions = torch.cumsum(mask, dim=1) * mask + c.pad_token_id
        else:
            positions = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]
        if type_ids is None:
            type_ids = torch.zeros_like(token_ids)
        x = F.embedding(token_ids, self._w("embeddings.word_embeddings.weight"))
        x = x + F.embedding(positions, self._w("embeddings.position_embeddings.weight"))
        if "embeddings.token_type_embeddings.weight" in self.weights:
            x = x + F.embedding(type_ids, self._w("embeddings.token_type_embeddings.weight"))
        x = self._layer_norm(x, "embeddings.LayerNorm")
        # (B, 1, 1, T): padded keys get -inf before the softmax
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(mask == 0, torch.finfo(x.dtype).min)[:, None, None, :]
        for j in range(c.num_layers):
            x = self._layer(x, bias, f"encoder.layer.{j}")
        return x

    def _layer(self, x: torch.Tensor, bias: torch.Tensor, name: str) -> torch.Tensor:
        c = self.config
        batch, length, _ = x.shape
        head_dim = c.hidden_size // c.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, nh, T, hs)
            return t.view(batch, length, c.num_heads, head_dim).transpose(1, 2)

        q = heads(self._linear(x, f"{name}.attention.self.query"))
        k = heads(self._linear(x, f"{name}.attention.self.key"))
        v = heads(self._linear(x, f"{name}.attention.self.value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
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
