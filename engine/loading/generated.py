"""Building model directories in this process: the demo model, `dummy:` shapes and converted
GGUF checkpoints (the default model is one)."""

from __future__ import annotations

from pathlib import Path

from engine.core.model_files import DEMO_MODEL, DUMMY_PREFIX, gguf_file, resolve_model_dir


def build_model_dir(model: str) -> Path:
    """The directory of a reference for which `needs_build` is true, built now if it is not
    in the cache yet."""
    if model == DEMO_MODEL:
        from engine.loading.demo import demo_model_dir

        return demo_model_dir()
    if model.startswith(DUMMY_PREFIX):
        from engine.loading.dummy import dummy_model_dir

        return dummy_model_dir(model.removeprefix(DUMMY_PREFIX))
    path = gguf_file(model)
    assert path is not None, f"{model!r} is not a reference engine.loading builds"
    from engine.loading.gguf_convert import gguf_model_dir

    return gguf_model_dir(path)


def local_model_dir(model: str | Path | None) -> Path:
    """`resolve_model_dir` for callers that may import torch: built models are built here."""
    return resolve_model_dir(None if model is None else str(model), build=build_model_dir)
