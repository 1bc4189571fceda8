"""A tiny Qwen3-VL daemon: an image in a chat request (the openai client) and in Batch API
lines (a data URL, a file under --allowed-local-media-path) gives transformers' greedy
tokens, as tests/server/test_vision_chat.py checks Qwen2.5-VL's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.qwen3_vl_models import build_tiny_qwen3_vl
from tests.server.live import ServerFactory
from tests.server.test_vision_chat import assert_chat_and_batch_answers, serve


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3_vl"))


def test_an_image_in_chat_and_batch_lines_gives_transformers_tokens(
    vl_dir: Path, make_server: ServerFactory, tmp_path: Path
) -> None:
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    assert_chat_and_batch_answers(serve(make_server, vl_dir, media_dir), vl_dir, media_dir)
