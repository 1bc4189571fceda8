"""The shell and Python examples of README.md and docs/*.md, and the rule that says how each
is checked: against a live daemon, run here (fast, in CI), run under the `slow` marker, or
skipped for a stated reason (a GPU, Docker, a figure written into bench/results, ...).

A shell block is cut into commands (continuation lines and quoted newlines joined); a Python
block is one example. `classify` gives every example exactly one rule, the first that
matches; an example no rule matches is an error (`tests/docs/test_doc_references.py`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
DAEMON_URL = re.compile(r"(localhost|127\.0\.0\.1):8000")


@dataclass(frozen=True)
class Example:
    """One command of a shell block, or one whole Python block."""

    doc: str
    """The document, relative to the repository root."""
    line: int
    """The block's first line in the document (1-based, the fence)."""
    lang: str
    """'bash' or 'python'."""
    code: str
    """A shell command (continuations joined), or the Python block."""

    @property
    def block(self) -> str:
        """Which block it came from, for test ids: 'README.md:58'."""
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class Rule:
    """How the examples it matches are checked."""

    name: str
    kind: str
    """'live' (a daemon on loopback: tests/docs/test_examples.py), 'fast' (run in CI),
    'slow' (run under the slow marker), 'setup' (runs with its block's others) or 'skip'."""
    reason: str
    """Why: what checks it, or why it cannot run on a CPU box."""
    matches: Callable[[Example], bool]


def _has(*needles: str) -> Callable[[Example], bool]:
    return lambda e: any(n in e.code for n in needles)


def _starts(*prefixes: str) -> Callable[[Example], bool]:
    return lambda e: e.code.lstrip().startswith(prefixes)


RULES = (
    Rule(
        "daemon process",
        "skip",
        "serves until stopped; tests/server/test_startup.py runs `nanoflex serve` itself",
        lambda e: e.code.startswith("make run") or "nanoflex serve" in e.code,
    ),
    Rule("make test", "skip", "is this test suite", _starts("make test")),
    Rule(
        "daemon",
        "live",
        "an HTTP call, or docs/api.md's session: run against `nanoflex serve` on the default "
        "model on loopback (tests/docs/test_examples.py)",
        lambda e: e.doc == "docs/api.md" or DAEMON_URL.search(e.code) is not None,
    ),
    Rule(
        "gpu",
        "skip",
        "needs a CUDA GPU (the GPU session of docs/benchmarks.md runs it)",
        _has("--device cuda", "-m gpu", "bench/gpu/", "bench.gpu."),
    ),
    Rule(
        "docker",
        "skip",
        "needs Docker; tests/docker checks the Dockerfiles and the compose file",
        _has("docker "),
    ),
    Rule(
        "docker host",
        "skip",
        "prepares a host for Docker as root (a base image, a folder for uid 1000, a wheel "
        "served on loopback); docker/ci.py does the same in CI's Docker step",
        _starts("sudo ", "(cd /opt/wheels", "apt-get install", "pgrep -x dockerd", "docker/"),
    ),
    Rule("upgrade", "skip", "updates the checkout (an upgrade)", _starts("git pull")),
    Rule(
        "worktree",
        "skip",
        "checks out an earlier commit beside this one (for a before/after figure)",
        _starts("git worktree add"),
    ),
    Rule(
        "peer",
        "skip",
        "builds vLLM's own virtualenv (a peer for benchmarks, minutes and gigabytes from PyPI)",
        _has("setup_vllm_venv.sh"),
    ),
    Rule(
        "figure",
        "skip",
        "records a figure in bench/results (run it under flock as docs/benchmarks.md says)",
        _has("bench/results", "--update-docs"),
    ),
    Rule(
        "cluster",
        "skip",
        "needs a Ray cluster (boxes joined with `ray start`, or KubeRay); "
        "tests/server/offline/scale_out runs `run-batch --ray` and the Ray Data processor on a "
        "local Ray instead",
        _has("--ray", "ray start", "helm ", "kubectl ", "ray.data", "nanoflex[ray]"),
    ),
    Rule(
        "long",
        "slow",
        "minutes on a 2-core CPU: a throughput run or a hardware profile",
        _has("nanoflex bench", "nanoflex profile"),
    ),
    Rule(
        "environment",
        "setup",
        "sets a variable for the block's other commands; runs with them",
        _starts("export "),
    ),
    Rule(
        "command",
        "fast",
        "a nanoflex or python command that runs in seconds on a CPU",
        _starts(".venv/bin/nanoflex ", "nanoflex ", ".venv/bin/python -c", "echo "),
    ),
    Rule("python", "fast", "a Python block, run as a script", lambda e: e.lang == "python"),
)


def docs() -> list[Path]:
    """README.md and every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the fence, language, code) of every fenced block."""
    text = path.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in FENCE.finditer(text)
    ]


def commands(bash: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, a quoted string that spans
    lines kept whole, comment-only lines dropped."""
    out: list[str] = []
    pending = ""
    for line in bash.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append(pending.strip())
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return out


def examples() -> list[Example]:
    found = []
    for path in docs():
        doc = str(path.relative_to(ROOT))
        for line, lang, code in blocks(path):
            if lang == "python":
                found.append(Example(doc, line, lang, code))
            elif lang == "bash":
                found += [Example(doc, line, lang, c) for c in commands(code)]
    return found


def classify(example: Example) -> Rule | None:
    return next((rule for rule in RULES if rule.matches(example)), None)


def rule(name: str) -> Rule:
    """The rule called `name`."""
    return next(r for r in RULES if r.name == name)
