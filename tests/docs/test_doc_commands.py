"""The shell and Python examples of README.md and docs/*.md that a CPU box can run, run as
written in a scratch directory: the fast ones here, the long ones (a throughput run, a
hardware profile) under the `slow` marker. Which example is which, and why the others are
skipped, is the table of rules in tests/docs/doc_examples.py; the HTTP examples run against a
live daemon in tests/docs/test_examples.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.docs.doc_examples import ROOT, Example, blocks, classify, examples

VENV = Path(sys.executable).parent.parent
EXPECTED = {
    'generate --chat --prompt "What is the capital of France?"': "The capital of France is Paris.",
}
"""Output a command must print (beyond exiting 0 without a traceback)."""


def by_block(kinds: Iterable[str], needed: str) -> dict[str, list[Example]]:
    """Block -> its examples whose rule's kind is in `kinds`, for blocks holding at least one
    example of kind `needed`."""
    grouped: dict[str, list[Example]] = {}
    for example in examples():
        rule = classify(example)
        if rule is not None and rule.kind in kinds:
            grouped.setdefault(example.block, []).append(example)
    return {
        block: found
        for block, found in grouped.items()
        if any(getattr(classify(e), "kind", None) == needed for e in found)
    }


FAST = by_block({"setup", "fast"}, "fast")
SLOW = by_block({"setup", "fast", "slow"}, "slow")


def scratch(tmp_path: Path) -> Path:
    """A working directory as a user's checkout has it: `.venv`, and the batch input of
    docs/api.md as `requests.jsonl` (README's run-batch example names it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv").symlink_to(VENV)
    line = next(code for _, lang, code in blocks(ROOT / "docs" / "api.md") if lang == "jsonl")
    (tmp_path / "requests.jsonl").write_text(line)
    return tmp_path


def run_block(found: list[Example], cwd: Path, env: dict[str, str]) -> None:
    env = {
        **env,
        "PATH": f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("NANOFLEX_ENGINE_CLIENT", None)
    if found[0].lang == "python":
        for i, example in enumerate(found):
            script = cwd / f"example_{i}.py"
            script.write_text(example.code)
            check(example.code, run([str(VENV / "bin" / "python"), str(script)], cwd, env))
        return
    for example in found:
        check(example.code, run(["bash", "-ec", example.code], cwd, env))


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)


def check(code: str, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, (code, done.stdout[-2000:], done.stderr[-4000:])
    assert "Traceback" not in done.stderr, (code, done.stderr[-4000:])
    for command, output in EXPECTED.items():
        if command in code:
            assert output in done.stdout, (code, done.stdout)


@pytest.mark.parametrize("block", sorted(FAST))
def test_fast_examples_run_as_written(block: str, tmp_path: Path) -> None:
    run_block(FAST[block], scratch(tmp_path), dict(os.environ))


@pytest.mark.slow
@pytest.mark.parametrize("block", sorted(SLOW))
def test_long_examples_run_as_written(block: str, tmp_path: Path) -> None:
    """With a cache of their own: `nanoflex profile` must not replace this machine's."""
    env = {**os.environ, "NANOFLEX_CACHE": str(tmp_path / "cache")}
    run_block(SLOW[block], scratch(tmp_path / "work"), env)


def test_the_batch_input_of_the_docs_is_one_request() -> None:
    """The first Batch API file of docs/api.md (the one the README's run-batch reads) is one
    chat request; the others are its structured-output example."""
    line = next(code for _, lang, code in blocks(ROOT / "docs" / "api.md") if lang == "jsonl")
    assert json.loads(line)["url"] == "/v1/chat/completions"
