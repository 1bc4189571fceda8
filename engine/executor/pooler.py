"""`Pooler`: a decoder pooling model (engine/core/pooling.py) served by the generation engine.

A pooling request is a prefill only (`SamplingParams.pooling`): its last position's row of
the head layer is its answer instead of a token to sample. The head layer of a pooling
model is built for that, so the planner, the weight tiers and the block pipeline handle it
as any other layer:

- an embedder's head is the final norm alone: no LM head is read or placed (Qwen3-Embedding
  ships none; a tied one would otherwise be copied onto the head's tier); its row (hidden,)
  is the vector, made unit length when the model declares `Normalize`;
- a decoder reranker's head is the final norm and a one-row classifier, `score.weight`
  (1, hidden) = W[yes] - W[no] of the LM head (or of the tied embeddings), read in place of
  the (vocab, hidden) LM head: its logit is logit(yes) - logit(no), and the score
  sigmoid(logit) equals P(yes) of a softmax over the two (Qwen3-Reranker's model card; as
  vLLM converts it); a checkpoint with its own one-logit `score` head uses that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.core.model_files import ModelLoadError
from engine.core.pooling import PoolingSpec
from engine.models.base import Model
from engine.models.llama import LlamaModel
from engine.storage.weight_store import TensorReader

SCORE = "score.weight"
"""The head's classifier (1, hidden): a reranker's checkpoint's own, or made by `_Reader`."""
LM_HEADS = ("lm_head.weight",)
TIED = ("model.embed_tokens.weight", "embed_tokens.weight")


@dataclass(frozen=True, slots=True)
class Pooler:
    """How the engine turns a pooling request's head row into its answer."""

    spec: PoolingSpec

    @staticmethod
    def of(spec: PoolingSpec, model: Model) -> Pooler:
        """The pooler of a decoder pooling model; marks `model`'s head as a pooling head.
        Raises ModelLoadError for an encoder or a family whose head cannot pool."""
        if spec.is_encoder:
            raise ModelLoadError("an encoder pooling model runs on the pooling runner")
        if not isinstance(model, LlamaModel) or type(model).head is not LlamaModel.head:
            raise ModelLoadError(
                f"pooling is served for Llama-family and Qwen 3 decoders, not "
                f"{model.config.model_type}"
            )
        model.pooling = spec.task
        return Pooler(spec)

    def reader(self, reader: TensorReader) -> TensorReader:
        """The checkpoint as this pooling head reads it (see the module's docstring)."""
        return _Reader(reader, self.spec.task, self.spec.classifier_token_ids, self.spec.dimensions)

    def outputs(self, rows: torch.Tensor) -> list[list[float]]:
        """A step's pooling requests' head rows, float32 (P, hidden) or (P, 1) -> their
        answers, one host copy for all of them: the vectors, or [score] each."""
        if self.spec.task == "score":
            return rows[:, :1].sigmoid().tolist()
        return (F.normalize(rows, dim=-1) if self.spec.normalize else rows).tolist()


class _Reader:
    """A checkpoint without its LM head (an embedder), or with `score.weight` made from it (a
    decoder reranker with classifier tokens)."""

    def __init__(
        self, reader: TensorReader, task: str, token_ids: tuple[int, ...], hidden: int
    ) -> None:
        self._reader, self._token_ids, self._hidden = reader, token_ids, hidden
        names = [n for n in reader.names if n not in LM_HEADS]
        self._source: str | None = None
        if task == "score" and token_ids:
            assert len(token_ids) == 2, "classifier tokens are (no, yes)"
            present = [n for n in (*LM_HEADS, *TIED) if n in reader.names]
            if not present:
                raise ModelLoadError("the reranker has neither an LM head nor token embeddings")
            self._source = present[0]
            names = [n for n in names if n != SCORE] + [SCORE]
        elif task == "score" and SCORE not in names:
            raise ModelLoadError("the reranker has no score head and no classifier tokens")
        self._names = names

    @property
    def names(self) -> list[str]:
        return self._names

    def numel(self, name: str) -> int:
        if name == SCORE and self._source is not None:
            return self._hidden
        return self._reader.numel(name)

    def get(self, name: str) -> torch.Tensor:
        if name != SCORE or self._source is None:
            return self._reader.get(name)
        no, yes = self._token_ids
        rows = self._reader.get(self._source)[[no, yes]].float()  # (2, hidden)
        return (rows[1] - rows[0])[None]  # (1, hidden)
