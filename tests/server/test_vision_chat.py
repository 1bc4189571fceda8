"""Images in chat requests to a tiny Qwen2.5-VL daemon: a data URL part (the openai client), a
local file under --allowed-local-media-path, and a Batch API line give transformers' greedy
tokens; what may not be read, or is over a limit, is a 400 in OpenAI's envelope."""

from __future__ import annotations

import argparse
import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from server.cli import main as cli_main
from server.openai.media import MediaLimits, add_media_arguments, media_limits_from
from tests.engine.vision_models import assert_same_answer, build_tiny_vl, hf_vl_generate, png_bytes
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import LiveServer, ServerFactory
from tests.server.test_errors import assert_error

MODEL = "tiny-qwen2.5-vl"
TEXT = "what is this?"
MAX_TOKENS = 5
GREEDY_IDS = {"logprobs": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
"""The answer's tokens read as ids (random weights' tokens are no text), EOS ignored."""


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_message(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": TEXT},
        ],
    }


def answer(logprobs: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(the chosen tokens, their log-probabilities) of a chat choice's logprobs, its tokens
    named "token_id:<id>"."""
    entries = logprobs["content"]
    return [int(e["token"].removeprefix("token_id:")) for e in entries], [
        e["logprob"] for e in entries
    ]


def chat_answer(api: Any, model: str, url: str) -> tuple[list[int], list[float], int]:
    """(the greedy tokens, their log-probabilities, the prompt's tokens) of a chat with the
    image at `url` and `TEXT`, sent by the openai client."""
    reply = api.chat.completions.create(
        model=model,
        messages=[image_message(url)],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    assert reply.choices[0].logprobs is not None and reply.usage is not None
    return *answer(reply.choices[0].logprobs.model_dump()), reply.usage.prompt_tokens


def reference(vl_dir: Path, image: bytes) -> tuple[list[int], list[float]]:
    _, tokens, logprobs = hf_vl_generate(vl_dir, [image], TEXT, MAX_TOKENS)
    return tokens, logprobs


def serve(make_server: ServerFactory, vl_dir: Path, media_dir: Path) -> LiveServer:
    args = EngineArgs(model=str(vl_dir), policy=Policy(), device="cpu")
    engine = StepLoopClient(args, vl_dir, Policy(), model_name=MODEL, in_process=True)
    limits = MediaLimits(max_images=2, max_image_bytes=60_000, allowed_local_media_path=media_dir)
    return make_server(engine, media_limits=limits)


def test_images_in_chat_and_batch_lines_give_transformers_tokens(
    vl_dir: Path, make_server: ServerFactory, tmp_path: Path
) -> None:
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    live = serve(make_server, vl_dir, media_dir)
    assert_chat_and_batch_answers(live, vl_dir, media_dir)
    first = png_bytes(60, 90, seed=1)
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **GREEDY_IDS}
    with live.http() as client:
        for url, code in (
            ("https://example.com/a.png", "image_url_not_allowed"),
            (f"file://{tmp_path / 'outside.png'}", "image_url_not_allowed"),
            (data_url(png_bytes(200, 200, seed=6)), "image_too_large"),  # over 60,000 bytes
            ("data:image/png;base64,bm90IGFuIGltYWdl", "invalid_value"),  # "not an image"
        ):
            refused = client.post(
                "/v1/chat/completions", json={**body, "messages": [image_message(url)]}
            )
            assert assert_error(refused, 400, code)["param"] == "messages.0.content.0"
        three = [image_message(data_url(first))["content"][0]] * 3
        refused = client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": three}]}
        )
        assert_error(refused, 400, "too_many_images")


def assert_chat_and_batch_answers(live: LiveServer, vl_dir: Path, media_dir: Path) -> None:
    """An image as a data URL in a chat request (the openai client), then in a Batch API line
    beside one read from a file under `media_dir` (the server's allowed path): each answer
    is transformers' greedy answer for its image."""
    first, second = png_bytes(60, 90, seed=1), png_bytes(100, 70, seed=5)
    (media_dir / "page.png").write_bytes(second)
    want = {"a": reference(vl_dir, first), "b": reference(vl_dir, second)}
    api = live.openai()
    tokens, logprobs, prompt_tokens = chat_answer(api, MODEL, data_url(first))
    assert_same_answer(tokens, logprobs, want["a"])
    assert prompt_tokens > 6 * 4  # its image tokens
    urls = {"a": data_url(first), "b": f"file://{media_dir / 'page.png'}"}
    for key, got in batch_answers(api, MODEL, urls).items():
        assert_same_answer(*got, want[key])


def batch_answers(
    api: Any, model: str, urls: dict[str, str]
) -> dict[str, tuple[list[int], list[float]]]:
    """custom_id -> (greedy tokens, their log-probabilities) of a Batch API job of one chat
    line per image in `urls` (custom_id -> image URL), each with `TEXT`."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, **GREEDY_IDS}
    lines = [
        json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions",
                    "body": {**body, "messages": [image_message(url)]}})
        for key, url in urls.items()
    ]  # fmt: skip
    batch = api.batches.create(
        input_file_id=upload(api, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(api, batch.id, timeout_s=120)
    assert done.status == "completed" and done.output_file_id is not None
    return {
        line["custom_id"]: answer(line["response"]["body"]["choices"][0]["logprobs"])
        for line in read_lines(api, done.output_file_id)
    }


def assert_one_size_images_match(
    make_server: ServerFactory,
    model_dir: Path,
    model: str,
    generate: Callable[[Path, list[bytes], str, int], tuple[list[int], list[int], list[float]]],
    tokens_per_image: int,
) -> None:
    """A daemon of a model that resizes every image to one size (Gemma 3, LLaVA): an image as
    a data URL in a chat (the openai client) and two in Batch API lines give `generate`'s
    (transformers') greedy answers, the prompt as long as its processor's."""
    first, second = png_bytes(60, 90, seed=1), png_bytes(100, 70, seed=5)
    want = {}
    for key, image in (("a", first), ("b", second)):
        want_ids, *tokens = generate(model_dir, [image], TEXT, MAX_TOKENS)
        want[key] = (tokens[0], tokens[1])
    assert want["a"][1] != want["b"][1]  # the two images give two answers
    args = EngineArgs(model=str(model_dir), policy=Policy(), device="cpu")
    engine = StepLoopClient(args, model_dir, Policy(), model_name=model, in_process=True)
    api = make_server(engine, media_limits=MediaLimits(max_images=2)).openai()
    tokens, logprobs, prompt_tokens = chat_answer(api, model, data_url(first))
    assert_same_answer(tokens, logprobs, want["a"])
    # the processor's prompt: its length, the image's tokens (and markers) included
    assert prompt_tokens == len(want_ids) and len(want_ids) > tokens_per_image
    urls = {"a": data_url(first), "b": data_url(second)}
    for key, got in batch_answers(api, model, urls).items():
        assert_same_answer(*got, want[key])


def test_run_batch_reads_images_under_the_allowed_path(vl_dir: Path, tmp_path: Path) -> None:
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    image = png_bytes(70, 60, seed=7)
    (media_dir / "p.png").write_bytes(image)
    (tmp_path / "outside.png").write_bytes(image)
    body = {"model": str(vl_dir), "max_tokens": MAX_TOKENS, "temperature": 0, **GREEDY_IDS}
    lines = [
        json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions",
                    "body": {**body, "messages": [image_message(f"file://{path}")]}})
        for key, path in (("in", media_dir / "p.png"), ("out", tmp_path / "outside.png"))
    ]  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(vl_dir)]
    argv += [
        "--device",
        "cpu",
        "--policy",
        str(policy),
        "--allowed-local-media-path",
        str(media_dir),
    ]
    assert cli_main(argv) == 0
    (line,) = [json.loads(raw) for raw in out.read_text().splitlines()]
    assert line["custom_id"] == "in"
    choice = line["response"]["body"]["choices"][0]
    assert_same_answer(*answer(choice["logprobs"]), reference(vl_dir, image))
    (error,) = [json.loads(raw) for raw in Path(f"{out}.errors").read_text().splitlines()]
    assert error["custom_id"] == "out" and "outside the allowed" in json.dumps(error)


def test_image_limit_flags_under_one_are_refused() -> None:
    parser = argparse.ArgumentParser()
    add_media_arguments(parser)
    assert media_limits_from(parser.parse_args([])) == MediaLimits()
    for flag in ("--max-image-bytes", "--max-images-per-request"):
        for value in ("0", "-1"):
            with pytest.raises(UserError, match=flag):
                media_limits_from(parser.parse_args([flag, value]))
