"""Ray is optional: the local run-batch runs without importing it, and `--ray` without Ray
installed is a one-line error naming the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.server.offline.test_run_batch import MODEL, line, write_input

ROOT = Path(__file__).resolve().parents[4]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_local_run_batch_never_imports_ray(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", [line("a", max_tokens=2)])
    argv = ["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL]
    code = f"""
import sys
from server.cli import main
assert main({[*argv, "--device", "cpu"]!r}) == 0
bad = sorted(m for m in sys.modules if m.split('.')[0] == 'ray')
assert not bad, bad
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 1


def test_ray_flag_without_ray_installed_says_what_to_install(tmp_path: Path) -> None:
    inp = write_input(tmp_path / "in.jsonl", [line("a")])
    argv = ["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--ray"]
    code = f"""
import sys
sys.modules["ray"] = None  # what `import ray` finds when it is not installed: ImportError
from server.cli import main
sys.exit(main({argv!r}))
"""
    done = run_python(code)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "nanoflex run-batch: error: --ray needs Ray: pip install 'nanoflex[ray]'"
    )
    assert not (tmp_path / "out.jsonl").exists()
