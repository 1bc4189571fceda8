"""The command line speaks vLLM's language (issue 12, item 6): a positional MODEL beside
`--model`, `--served-model-name`, `--dtype`, `--max-model-len`, `--version`, bench's
`--input-len/--output-len` beside FlexGen's names, every flag's help naming its default, and
`generate --chat`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.runtime.step_loop_client import build_engine_client
from policy import Policy
from server.cli import COMMANDS, DefaultsHelpFormatter, build_parser
from server.http.settings import ServerSettings
from tests.server.live import engine_args, start_server

ROOT = Path(__file__).resolve().parents[2]
NANOFLEX = Path(sys.executable).parent / "nanoflex"


def nanoflex(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(NANOFLEX), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_says_what_it_does_and_names_its_default(command: str) -> None:
    parser = subparser(command)
    formatter = DefaultsHelpFormatter(prog="nanoflex")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.metavar
        assert action.help and action.help.strip(), f"{command} {name} has no help"
        text = formatter._expand_help(action)
        assert "default" in text or "required" in text, (command, name, text)
        if isinstance(action.default, int | float) and not isinstance(action.default, bool):
            assert str(action.default) in text, (command, name, text)


def test_help_as_printed_names_defaults() -> None:
    run = nanoflex("serve", "--help")
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    for shown in ("port to bind (default: 8000)", "(default: 127.0.0.1)", "[MODEL]"):
        assert shown in text, shown
    run = nanoflex("bench", "--help")
    assert "--input-len N, --prompt-len N" in run.stdout


def test_version() -> None:
    run = nanoflex("--version")
    assert run.returncode == 0 and run.stdout.startswith("nanoflex "), run
    assert run.stdout.split()[1][0].isdigit()


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argv[0]).parse_args(list(argv))


def test_the_model_is_positional_or_a_flag() -> None:
    assert EngineArgs.from_cli_args(parse("serve", DEMO_MODEL)).model == DEMO_MODEL
    assert EngineArgs.from_cli_args(parse("serve", "--model", DEMO_MODEL)).model == DEMO_MODEL
    both = parse("bench", DEMO_MODEL, "--model", DEMO_MODEL, "--input-len", "4")
    assert EngineArgs.from_cli_args(both).model == DEMO_MODEL
    assert EngineArgs.from_cli_args(parse("run-batch", "-i", "a", "-o", "b")).model is None
    with pytest.raises(UserError, match="two models given"):
        EngineArgs.from_cli_args(parse("generate", "a-model", "--model", "b", "--prompt", "x"))


def test_bench_takes_vllm_and_flexgen_length_names() -> None:
    new = parse("bench", "--input-len", "7", "--output-len", "3")
    old = parse("bench", "--prompt-len", "7", "--gen-len", "3")
    assert (new.prompt_len, new.gen_len) == (old.prompt_len, old.gen_len) == (7, 3)
    plan = parse("plan", "--input-len", "9", "--output-len", "2")
    assert (plan.prompt_len, plan.gen_len) == (9, 2)


def test_engine_flags_reach_the_engine() -> None:
    args = EngineArgs.from_cli_args(parse("serve", "--dtype", "bfloat16", "--max-model-len", "64"))
    assert (args.dtype, args.max_model_len) == ("bfloat16", 64)
    assert parse("serve", "--served-model-name", "m").served_model_name == "m"
    slots = EngineArgs.from_cli_args(parse("serve", "--prefix-state-slots", "3"))
    assert slots.prefix_state_slots == 3 and EngineArgs().prefix_state_slots == 8
    with pytest.raises(UserError, match="prefix_state_slots must be >= 0, got -1"):
        EngineArgs.from_cli_args(parse("serve", "--prefix-state-slots", "-1"))
    serve = parse("serve", "--tool-call-parser", "mistral", "--reasoning-parser", "none")
    settings = ServerSettings.from_args(serve)
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("mistral", "none")


def test_served_model_name_and_max_model_len_on_a_live_daemon(tmp_path: Path) -> None:
    args = engine_args(served_model_name="my-model", max_model_len=64)
    settings = ServerSettings.from_args(
        build_parser("serve").parse_args(
            ["serve", "--data-dir", str(tmp_path), "--served-model-name", "my-model"]
        )
    )
    live = start_server(settings, build_engine_client(args))
    try:
        client = live.openai()
        (model,) = client.models.list().data
        assert model.id == "my-model" and model.model_extra == {"max_model_len": 64}
        done = client.completions.create(model="my-model", prompt="Hi", max_tokens=2)
        assert done.choices[0].finish_reason == "length"
        with live.http() as http:
            other = http.post("/v1/completions", json={"model": DEMO_MODEL, "prompt": "Hi"})
            assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
            too_long = http.post(
                "/v1/completions", json={"model": "my-model", "prompt": "Hi", "max_tokens": 64}
            )
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    finally:
        live.stop()


def test_max_model_len_over_the_model_is_one_line(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    common = ["--device", "cpu", "--policy", str(policy), "--prompt", "Hi", "--max-tokens", "1"]
    run = nanoflex("generate", DEMO_MODEL, "--max-model-len", "1000000", *common)
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "nanoflex generate: error: --max-model-len 1000000 is over the model's context window"
        )
    ), run.stderr


def test_generate_chat_applies_the_template_and_plain_text_says_when_it_is_needed(
    tmp_path: Path,
) -> None:
    """SmolLM2-135M-Instruct (the default model) given the bare question ends at once; asked
    as a chat message it answers."""
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    question = "What is the capital of France?"
    common = ["--device", "cpu", "--policy", str(policy), "--prompt", question]
    plain = nanoflex("generate", *common, "--max-tokens", "8")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == question
    assert "pass --chat to send the prompt as a chat message" in plain.stderr
    chat = nanoflex("generate", *common, "--chat", "--max-tokens", "16")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() == "The capital of France is Paris."
    assert "--chat" not in chat.stderr
