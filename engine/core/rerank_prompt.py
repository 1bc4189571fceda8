"""A decoder reranker's input for one (query, document) pair (torch-free): Qwen3-Reranker's
model card's prompt, tokenized as the card does (prefix, the pair's lines, suffix, each on
its own, no special tokens added), so that its score equals the card's computation.

A `text_1` that already begins with the card's prefix is taken as the client formatted it
(as vLLM's Qwen3-Reranker examples send: text_1 = prefix + instruction and query, text_2 =
document + suffix): their tokens are joined as they are, as vLLM joins a decoder's pair.
"""

from __future__ import annotations

from collections.abc import Callable

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""The card's default task instruction."""


def rerank_token_ids(encode: Callable[[str], list[int]], query: str, document: str) -> list[int]:
    """The pair's token ids; `encode` tokenizes without special tokens."""
    if query.startswith("<|im_start|>system"):  # formatted by the client (vLLM's examples)
        return encode(query) + encode(document)
    body = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return encode(PREFIX) + encode(body) + encode(SUFFIX)
