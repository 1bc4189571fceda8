"""Images in chat requests to a tiny Gemma 3 daemon (its SigLIP tower, its image tokens seen
both ways): a data URL part through the openai client and two Batch API lines give
transformers' greedy tokens for the prompt its own processor writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.gemma3_vision_model import TOKENS_PER_IMAGE, build_tiny_gemma3, hf_gemma3_generate
from tests.server.live import ServerFactory
from tests.server.test_vision_chat import assert_one_size_images_match

MODEL = "tiny-gemma3"


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def test_images_in_chat_and_batch_lines_give_transformers_tokens(
    gemma3_dir: Path, make_server: ServerFactory
) -> None:
    assert_one_size_images_match(
        make_server, gemma3_dir, MODEL, hf_gemma3_generate, TOKENS_PER_IMAGE
    )
