"""Images in chat requests to a tiny LLaVA daemon (its CLIP tower, its image tokens causal as
text): a data URL part through the openai client and two Batch API lines give transformers'
greedy tokens for the prompt its own processor writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.llava_model import TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_generate
from tests.server.live import ServerFactory
from tests.server.test_vision_chat import assert_one_size_images_match

MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def test_images_in_chat_and_batch_lines_give_transformers_tokens(
    llava_dir: Path, make_server: ServerFactory
) -> None:
    assert_one_size_images_match(make_server, llava_dir, MODEL, hf_llava_generate, TOKENS_PER_IMAGE)
