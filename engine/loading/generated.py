"""Building generated models in this process: the demo model and `dummy:` shapes."""

from __future__ import annotations

from pathlib import Path

from engine.core.model_files import DEMO_MODEL, DUMMY_PREFIX, resolve_model_dir


def build_generated(model: str | None) -> Path:
    """The directory of a generated model (None or DEMO_MODEL: the demo model; `dummy:<name>`),
    built now if it is not in the cache yet."""
    if model is None or model == DEMO_MODEL:
        from engine.loading.demo import demo_model_dir

        return demo_model_dir()
    from engine.loading.dummy import dummy_model_dir

    return dummy_model_dir(model.removeprefix(DUMMY_PREFIX))


def local_model_dir(model: str | Path | None) -> Path:
    """`resolve_model_dir` for callers that may import torch: generated models are built here."""
    return resolve_model_dir(None if model is None else str(model), build=build_generated)
