"""Finding a model directory (local path, hub id or the demo model) without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from policy.errors import UserError

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


class ModelLoadError(UserError):
    """The model could not be found or read."""


def resolve_model_dir(model: str | None, *, torch_free: bool = False) -> Path:
    """A local directory holding config.json and weights: the demo model when `model` is None,
    `model` itself when it is a directory, a config-only directory with generated weights for
    `dummy:<built-in name or config dir>`, otherwise a hub id downloaded to the hub cache.
    With `torch_free`, a demo model not yet built is built in a child process, so that the
    calling process (the daemon) never imports torch."""
    if model is not None and model.startswith("dummy:"):  # generated weights (engine/dummy.py)
        return _dummy_dir(model.removeprefix("dummy:"), torch_free=torch_free)
    if model is None:
        from engine import demo

        if torch_free and not (demo.cache_root() / demo.DEMO_NAME / "config.json").is_file():
            code = "from engine.demo import demo_model_dir; demo_model_dir()"
            subprocess.run([sys.executable, "-c", code], check=True)
        return demo.demo_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a model directory?")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path {model!r} is not a directory")
    return _download(model)


def _dummy_dir(name: str, *, torch_free: bool) -> Path:
    if torch_free:  # building the config imports transformers (and torch): do it in a child
        code = "import sys; from engine.dummy import dummy_model_dir as d; print(d(sys.argv[1]))"
        result = subprocess.run(
            [sys.executable, "-c", code, name], check=False, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise ModelLoadError(f"cannot make dummy model {name!r}: {result.stderr.strip()}")
        return Path(result.stdout.strip().splitlines()[-1])
    from engine.dummy import dummy_model_dir

    return dummy_model_dir(name)


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


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the checkpoint declares, in config.json and in
    generation_config.json (where Llama 3 and chat models list their turn terminators)."""
    import json

    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            for token_id in value if isinstance(value, list) else [value]:
                if isinstance(token_id, int) and token_id not in ids:
                    ids.append(token_id)
    return tuple(ids)
