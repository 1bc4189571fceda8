"""`PoolingRunner`: an encoder pooling model's forward on the compute device (BERT,
XLM-RoBERTa: engine/models/bert.py): vectors for token-id inputs (embed) and relevance
scores for token pairs (score), one dense forward pass per batch, no KV cache.

The whole model sits on the compute device: these encoders are small (bge-m3, the largest,
is 0.57B), so the planner's placement is not applied to them. Decoder pooling models
(Qwen3-Embedding, Qwen3-Reranker) run on the generation engine instead, with its planner,
tiers and offloading (engine/executor/pooler.py). Inputs run in batches of
`max_batch_tokens` padded tokens, longest first so that padding stays small. The budget is
the device's (`BATCH_TOKENS`): a GPU wants large batches, a CPU small ones, whose
activations stay in its caches (docs/benchmarks.md, "Embedding a corpus").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.core.pooling import PoolingSpec, pooling_spec
from engine.loading.checkpoint import CheckpointReader
from engine.models.bert import BertConfig, BertEncoder, encoder_weights
from engine.models.config import read_hf_config

BATCH_TOKENS = {"cpu": 2048, "cuda": 16384}
"""Padded tokens of one forward pass per device type. On the CPU a pass's elementwise ops
(GELU, LayerNorm, residual adds) stream (N, 4H) activations from memory once they leave the
caches: 16,384 tokens ran all-MiniLM-L6-v2 at 0.8x the rate of 2,048 (one thread, 640
passages, bench/peers/embed_corpus.py's corpus); 512-4,096 were within noise of each other."""

Pair = tuple[list[int], list[int]]
"""A cross-encoder input: its token ids and their token type ids (0 query, 1 document)."""


@dataclass(slots=True)
class PoolingRunner:
    """One loaded pooling model (`load`), its `embed` and `score`."""

    spec: PoolingSpec
    model: BertEncoder
    device: torch.device
    max_batch_tokens: int = BATCH_TOKENS["cuda"]

    @staticmethod
    def load(
        model_dir: Path,
        spec: PoolingSpec,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        packed: bool = True,
    ) -> PoolingRunner:
        """The encoder in `model_dir` on `device`; `packed`: its dense layers run on the real
        tokens only (`BertEncoder.is_packed`)."""
        if not spec.is_encoder:
            raise ValueError(f"{model_dir} is a decoder: the generation engine pools it")
        reader = CheckpointReader(model_dir)
        weights = {name: reader.get(name).to(device=device, dtype=dtype) for name in reader.names}
        config = BertConfig.from_hf(read_hf_config(model_dir).to_dict())
        model = BertEncoder(config, encoder_weights(weights), is_packed=packed)
        where = torch.device(device)
        budget = BATCH_TOKENS.get(where.type, BATCH_TOKENS["cuda"])
        return PoolingRunner(spec, model, where, max_batch_tokens=budget)

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Input indices in batches, longest first, each at most `max_batch_tokens` padded."""
        order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
        batches: list[list[int]] = []
        for k in order:
            if (
                batches
                and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= self.max_batch_tokens
            ):
                batches[-1].append(k)
            else:
                batches.append([k])
        return batches

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (B, T) ids and their (B, T) 0/1 mask."""
        length = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), length), dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input (non-empty token ids), pooled and normalized as declared."""
        out: list[list[float]] = [[] for _ in inputs]
        for batch in self._batches([len(r) for r in inputs]):
            ids, mask = self._padded([inputs[k] for k in batch])
            hidden = self.model.hidden(ids, mask)
            vectors = _pool(self.spec.pooling, hidden.float(), mask)
            if self.spec.normalize:
                vectors = F.normalize(vectors, dim=-1)
            for k, vector in zip(batch, vectors.cpu().tolist(), strict=True):
                out[k] = vector
        return out

    @torch.inference_mode()
    def score(self, pairs: list[Pair]) -> list[float]:
        """A cross-encoder's score per pair: its first logit, through a sigmoid when the
        head has one label (sentence-transformers' CrossEncoder default, as vLLM serves)."""
        model = self.model
        assert self.spec.task == "score"
        out = [0.0] * len(pairs)
        for batch in self._batches([len(ids) for ids, _ in pairs]):
            ids, mask = self._padded([pairs[k][0] for k in batch])
            types, _ = self._padded([pairs[k][1] for k in batch])
            logits = model.classify(model.hidden(ids, mask, types)).float()
            scores = logits[:, 0].sigmoid() if logits.shape[1] == 1 else logits[:, 0]
            for k, value in zip(batch, scores.cpu().tolist(), strict=True):
                out[k] = value
        return out


def load_runner(
    model_dir: str, device: str = "auto", dtype: str | None = None, packed: bool = True
) -> PoolingRunner:
    """The runner of the pooling model in `model_dir` (the pooling client's factory):
    `device` auto picks CUDA when there is one; `dtype` None is float32 on the CPU, the
    checkpoint's half type on CUDA (bfloat16 when it declares none); `packed` as `load`."""
    spec = pooling_spec(Path(model_dir))
    if spec is None:
        raise ValueError(f"{model_dir} declares no pooling (engine/core/pooling.py)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    return PoolingRunner.load(Path(model_dir), spec, device, getattr(torch, dtype), packed)


def _pool(pooling: str, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) hidden states of right-padded rows -> (B, H)."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = mask.sum(dim=1) - 1  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = mask[:, :, None].to(hidden.dtype)  # mean over the real tokens
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
