"""Finding a model directory and reading the facts the scheduler needs from it (torch-free).

A model reference is one of:
- None (the default model) or `nanoflex-demo`: the built-in demo model, a small random-weight
  Llama generated into the cache on first use (fast; for tests and a first look);
- `dummy:<built-in name or config dir>`: a config-only directory whose weights are generated
  on demand (benchmarks of a model's shape, FlexGen's `_DUMMY_`);
- a local directory holding config.json and weights;
- a Hugging Face hub id, downloaded into the hub cache.

Generated models are built by `engine.loading`, which imports torch. The daemon must not,
so by default they are built in a child process (`python -m engine.loading REF`); the
engine passes its in-process builder instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from policy.errors import UserError

DUMMY_PREFIX = "dummy:"
DEMO_MODEL = "nanoflex-demo"
"""The reference (and served name) of the built-in demo model."""
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]

BuildFn = Callable[[str | None], Path]
"""Builds a generated model (None or DEMO_MODEL: the demo model; `dummy:<shape>`) -> its
directory."""


class ModelLoadError(UserError):
    """The model could not be found or read."""


def is_generated(model: str | None) -> bool:
    """True for references whose directory `engine.loading` builds (demo, `dummy:`)."""
    return model is None or model == DEMO_MODEL or model.startswith(DUMMY_PREFIX)


def build_in_child(model: str | None) -> Path:
    """Build a generated model in a child process, so that this process never imports torch."""
    argv = [sys.executable, "-m", "engine.loading", "" if model is None else model]
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()
        raise ModelLoadError(
            f"cannot build model {model or 'demo'!r}: {detail[-1] if detail else 'no output'}"
        )
    return Path(result.stdout.strip().splitlines()[-1])


def resolve_model_dir(model: str | None, *, build: BuildFn = build_in_child) -> Path:
    """A local directory holding config.json (and weights, or a dummy marker) for `model`.
    Generated models go to `build`; hub ids are downloaded to the hub cache."""
    if is_generated(model):
        return build(model)
    assert model is not None
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a model directory?")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path {model!r} is not a directory")
    return _download(model)


def _download(repo_id: str) -> Path:
    """Fetch config, tokenizer and weights of a hub model (safetensors preferred over .bin)."""
    try:
        from huggingface_hub import list_repo_files, snapshot_download

        files = list_repo_files(repo_id)
        patterns = list(_HUB_PATTERNS)
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub client raises many types: network, auth, not found
        raise ModelLoadError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local directory with --model instead"
        ) from e


def _read_json(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    return value if isinstance(value, dict) else {}


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the checkpoint declares, in config.json and in
    generation_config.json (where Llama 3 and chat models list their turn terminators)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def context_length(model_dir: Path, default: int = 2048) -> int:
    """The model's context window: config.json's max_position_embeddings."""
    value = _read_json(model_dir / "config.json").get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else default
