"""A newer family's chat template through the daemon and `generate --chat`: a GGUF-converted
Gemma 3 whose template (as Gemma's do) refuses a system message answers a user turn with the
offline engine's tokens, and a system message with one clear 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_args import EngineArgs
from engine.loading.gguf_convert import gguf_model_dir
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from server.cli import main
from tests.engine.loading.gguf_families import build_gguf_checkpoint, write_family_gguf
from tests.server.live import ServerFactory
from tests.server.test_errors import assert_error

MODEL = "tiny-gemma3"


@pytest.fixture
def gemma_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))
    hf_dir = build_gguf_checkpoint("gemma3", tmp_path / "hf")
    return gguf_model_dir(write_family_gguf(hf_dir, tmp_path / "gemma3.gguf", "Q8_0"))


def offline_answer(model_dir: Path, user: dict[str, str], **params: Any) -> str:
    """The offline engine's greedy 5-token answer to one user message."""
    with LLM(str(model_dir), policy=Policy(), device="cpu") as llm:
        assert llm.tokenizer is not None
        ids = llm.tokenizer.apply_chat_template([user])
        sampling = SamplingParams(max_tokens=5, temperature=0.0, **params)
        return llm.generate([ids], sampling)[0].outputs[0].text


def test_chat_completions_render_the_family_template(
    gemma_dir: Path, make_server: ServerFactory
) -> None:
    user = {"role": "user", "content": "the train in Athens"}
    expected = offline_answer(gemma_dir, user, ignore_eos=True)
    args = EngineArgs(model=str(gemma_dir), policy=Policy(), device="cpu")
    engine = StepLoopClient(args, gemma_dir, Policy(), model_name=MODEL, in_process=True)
    with make_server(engine).http() as client:
        body = {"model": MODEL, "messages": [user], "max_tokens": 5, "temperature": 0}
        answer = client.post("/v1/chat/completions", json={**body, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected
        system = {"role": "system", "content": "Be brief."}
        refused = client.post("/v1/chat/completions", json={**body, "messages": [system, user]})
        error = assert_error(refused, 400, "chat_template_error")
        assert "System role not supported" in error["message"] and error["param"] == "messages"


def test_generate_chat_renders_the_family_template(
    gemma_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "the train in Athens"
    expected = offline_answer(gemma_dir, {"role": "user", "content": prompt})
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    argv = ["generate", str(gemma_dir), "--device", "cpu", "--policy", str(policy)]
    assert main([*argv, "--prompt", prompt, "--chat", "--max-tokens", "5"]) == 0
    assert expected and capsys.readouterr().out == expected + "\n"
