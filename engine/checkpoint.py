"""Finding a checkpoint (local directory, hub id or the demo model) and streaming its tensors."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from engine.model_files import ModelLoadError, resolve_model_dir

__all__ = [
    "CheckpointReader",
    "ModelLoadError",
    "TensorReader",
    "open_reader",
    "read_hf_config",
    "resolve_model_dir",
]


class TensorReader(Protocol):
    """What the weight store reads: tensors by checkpoint name (CheckpointReader, DummyReader)."""

    @property
    def names(self) -> list[str]: ...

    def numel(self, name: str) -> int: ...

    def get(self, name: str) -> torch.Tensor: ...


def open_reader(model_dir: Path) -> TensorReader:
    """The checkpoint's tensors, or generated ones for a `dummy:` model directory."""
    from engine.dummy import DummyReader, is_dummy

    if is_dummy(model_dir):
        return DummyReader.from_model_dir(model_dir)
    return CheckpointReader(model_dir)


def read_hf_config(model_dir: Path) -> object:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the config in {model_dir}: {e}") from e


class CheckpointReader:
    """Random access to a checkpoint's tensors by name, without loading the whole file set:
    safetensors are opened lazily per tensor, .bin shards are memory-mapped."""

    def __init__(self, model_dir: Path) -> None:
        self._getters: dict[str, Callable[[], torch.Tensor]] = {}
        self._numels: dict[str, int] = {}
        safetensors = sorted(model_dir.glob("*.safetensors"))
        if safetensors:
            from safetensors import safe_open

            for path in safetensors:
                handle = safe_open(str(path), framework="pt")
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    self._getters[name] = partial(handle.get_tensor, name)
                    self._numels[name] = math.prod(handle.get_slice(name).get_shape())
            return
        bins = sorted(model_dir.glob("pytorch_model*.bin")) or sorted(model_dir.glob("*.bin"))
        if not bins:
            raise ModelLoadError(f"no *.safetensors or *.bin weights in {model_dir}")
        for path in bins:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name, tensor in state.items():
                self._getters[name] = partial(lambda t: t, tensor)
                self._numels[name] = tensor.numel()

    @property
    def names(self) -> list[str]:
        return list(self._getters)

    def numel(self, name: str) -> int:
        return self._numels[name]

    def get(self, name: str) -> torch.Tensor:
        return self._getters[name]()


def checkpoint_bytes(model_dir: Path) -> int:
    """Size of the weight files on disk (for progress reporting)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return int(json.loads(index.read_text()).get("metadata", {}).get("total_size", 0))
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or sum(
        p.stat().st_size for p in model_dir.glob("*.bin")
    )
