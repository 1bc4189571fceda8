"""Reading a checkpoint's tensors by name: safetensors (FP8 and MXFP4 ones dequantized) or .bin
files, or generated weights."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from engine.core.model_files import ModelLoadError
from engine.loading import mxfp4
from engine.loading.dummy import DummyReader, is_dummy
from engine.loading.fp8 import dequantizing_getters
from engine.models.quant_config import Fp8ConfigError, fp8_block_size, is_mxfp4


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
            self._dequantize(model_dir)
            return
        bins = sorted(model_dir.glob("pytorch_model*.bin")) or sorted(model_dir.glob("*.bin"))
        if not bins:
            raise ModelLoadError(f"no *.safetensors or *.bin weights in {model_dir}")
        for path in bins:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for name, tensor in state.items():
                self._getters[name] = partial(lambda t: t, tensor)
                self._numels[name] = tensor.numel()

    def _dequantize(self, model_dir: Path) -> None:
        """An FP8 checkpoint's weights (engine/loading/fp8.py) or an MXFP4 one's experts
        (engine/loading/mxfp4.py) read dequantized, their scales not listed; the config reader
        has refused other quantizations."""
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            return
        quantization = json.loads(config_path.read_text()).get("quantization_config")
        if is_mxfp4(quantization):
            self._getters, self._numels = mxfp4.dequantizing_getters(self._getters, self._numels)
            return
        try:
            block = fp8_block_size(quantization)
        except Fp8ConfigError:
            return  # refused by name when the config is read
        if block is not None:
            self._getters = dequantizing_getters(self._getters, block)
            self._numels = {n: self._numels[n] for n in self._getters}

    @property
    def names(self) -> list[str]:
        return list(self._getters)

    def numel(self, name: str) -> int:
        return self._numels[name]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._getters[name]()
        except Fp8ConfigError as e:
            raise ModelLoadError(f"cannot read {name}: {e}") from e
