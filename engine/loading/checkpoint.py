"""Reading a checkpoint's tensors by name: safetensors or .bin files, or generated weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from engine.core.model_files import ModelLoadError
from engine.loading.dummy import DummyReader, is_dummy


def open_reader(model_dir: Path) -> CheckpointReader | DummyReader:
    """The checkpoint's tensors, or generated ones for a `dummy:` model directory."""
    if is_dummy(model_dir):
        return DummyReader.from_model_dir(model_dir)
    return CheckpointReader(model_dir)


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
