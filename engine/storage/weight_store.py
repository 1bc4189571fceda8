"""`WeightStore`: each layer homed on one tier, loaded onto the compute device on demand."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.model_files import ModelLoadError
from engine.models.base import Model, Weights, can_prepack, prepack
from engine.storage.device import Device, Ready
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.quant import QuantizedTensor, dequantize, quantize
from policy import TIERS

Stored = torch.Tensor | QuantizedTensor


class TensorReader(Protocol):
    """What the weight store reads: tensors by checkpoint name (engine.loading's readers)."""

    @property
    def names(self) -> list[str]: ...

    def numel(self, name: str) -> int: ...

    def get(self, name: str) -> torch.Tensor: ...


_ALIGN = 64


def _parts(value: Stored) -> list[torch.Tensor]:
    """The plain tensors a stored value is made of: itself, or a quantized tensor's three."""
    if isinstance(value, QuantizedTensor):
        return [value.packed, value.scale, value.min]
    return [value]


def _rebuild(template: Stored, parts: list[torch.Tensor]) -> Stored:
    if isinstance(template, QuantizedTensor):
        packed, scale, minimum = parts
        return dataclasses.replace(template, packed=packed, scale=scale, min=minimum)
    return parts[0]


def nbytes_of(value: Stored) -> int:
    return sum(p.numel() * p.element_size() for p in _parts(value))


@dataclass(slots=True)
class StoredLayer:
    tier: str
    values: dict[str, Stored] = field(default_factory=dict)
    """gpu tier: on the compute device; cpu tier: host memory; disk tier: meta-only templates."""
    file: DiskFile | None = None
    offsets: list[int] = field(default_factory=list)
    """Disk tier: byte offset of each part, in `values` order then part order."""
    nbytes: int = 0


def assign_tiers(sizes: list[int], fracs: tuple[float, float, float]) -> list[str]:
    """Whole layers to tiers: a layer goes where the midpoint of its byte range falls, so the
    realized split is the closest to `fracs` that layer granularity allows."""
    total = float(sum(sizes)) or 1.0
    bounds = (fracs[0], fracs[0] + fracs[1])
    tiers, start = [], 0.0
    for size in sizes:
        mid = (start + size / 2) / total
        tiers.append(TIERS[0] if mid < bounds[0] else TIERS[1] if mid < bounds[1] else TIERS[2])
        start += size
    return tiers


EXPERTS_PREFIX = "experts."
"""A MoE layer's routed experts (engine/models/moe.py): `experts.<e>.gate_up.weight`, ..."""


def layer_fracs(
    weights_frac: tuple[float, float, float],
    experts_frac: tuple[float, float, float] | None,
    expert_bytes: int,
    total_bytes: int,
) -> tuple[float, float, float]:
    """The split of whole layers across tiers that homes the bytes the policy asks for: its
    weights_frac of the non-expert bytes plus, for a MoE model, its experts_frac of the routed
    experts' bytes (experts move with their layer: placing each expert on its own tier is not
    done yet, so a layer's experts share its tier)."""
    if experts_frac is None or not expert_bytes or not total_bytes:
        return weights_frac
    share = expert_bytes / total_bytes
    mixed = [(1 - share) * w + share * e for w, e in zip(weights_frac, experts_frac, strict=True)]
    return (mixed[0], mixed[1], mixed[2])


class WeightStore:
    """Reads a checkpoint layer by layer, casts, optionally compresses, and homes each layer."""

    def __init__(
        self,
        model: Model,
        reader: TensorReader,
        *,
        weights_frac: tuple[float, float, float],
        experts_frac: tuple[float, float, float] | None = None,
        compress: bool,
        dtype: torch.dtype,
        device: Device,
        disk: DiskIO,
        prepack: bool = False,
    ) -> None:
        """Plans where each layer goes (nothing is read yet: `planned_bytes` can be checked
        against the budgets first); `read_all` then reads and homes every layer.
        `prepack`: the compute device's uncompressed linear weights are stored prepacked
        for the CPU's GEMM (`engine.models.base.prepack`), where the CPU computes."""
        self.model, self.device, self.disk, self.dtype = model, device, disk, dtype
        self.reader, self.compress = reader, compress
        self.prepack = prepack and not compress and can_prepack(device.device, dtype)
        by_layer: list[dict[str, str]] = [{} for _ in range(model.num_layers)]
        for hf_name in reader.names:
            target = model.map_name(hf_name)
            if target is not None:
                by_layer[target[0]][target[1]] = hf_name
        embed_j, embed_name, head_name = model.tied_head_source()
        head = by_layer[-1]
        self._tied = head_name not in head
        if self._tied:  # the head reads the embedding's tensor (shared when on one tier)
            if embed_name not in by_layer[embed_j]:
                raise ModelLoadError("checkpoint has neither an LM head nor token embeddings")
            head[head_name] = by_layer[embed_j][embed_name]
        for j, names in enumerate(by_layer):
            if not names:
                raise ModelLoadError(f"checkpoint has no tensors for layer {j}")
        sizes = [
            sum(reader.numel(n) for n in names.values()) * dtype.itemsize for names in by_layer
        ]
        expert_bytes = sum(
            reader.numel(n) * dtype.itemsize
            for names in by_layer
            for name, n in names.items()
            if name.startswith(EXPERTS_PREFIX)
        )
        self.tiers = assign_tiers(
            sizes, layer_fracs(weights_frac, experts_frac, expert_bytes, sum(sizes))
        )
        self._sizes, self._by_layer = sizes, by_layer
        self.layers: list[StoredLayer] = []
        self._staging: queue.Queue[torch.Tensor] = queue.Queue()
        self._staging_bytes = 0

    def planned_bytes(self) -> dict[str, int]:
        """Bytes each tier will hold once loaded, uncompressed (an upper bound with 4-bit)."""
        out = dict.fromkeys(TIERS, 0)
        for tier, size in zip(self.tiers, self._sizes, strict=True):
            out[tier] += size
        if self._shares_head():
            out[self.tiers[-1]] -= self._sizes[-1] - self._head_only_bytes()
        return out

    def _shares_head(self) -> bool:
        """Tied embeddings on one memory tier, uncompressed: the head holds the embedding's
        tensor itself instead of a second copy (unless the head's is prepacked, a layout the
        embedding lookup cannot read)."""
        embed_j = self.model.tied_head_source()[0]
        same = self.tiers[embed_j] == self.tiers[-1] and self.tiers[-1] != "disk"
        prepacked = self.prepack and self.tiers[-1] == "gpu"
        return self._tied and same and not self.compress and not prepacked

    def _head_only_bytes(self) -> int:
        """The head layer's bytes without its tied weight."""
        head_name = self.model.tied_head_source()[2]
        names = self._by_layer[-1]
        return sum(self.reader.numel(n) for k, n in names.items() if k != head_name) * (
            self.dtype.itemsize
        )

    def read_all(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Read, cast, compress and home every layer."""
        model, dtype, compress = self.model, self.dtype, self.compress
        embed_j, embed_name, head_name = model.tied_head_source()
        for j, names in enumerate(self._by_layer):
            read: Weights = {}
            for local, hf_name in sorted(names.items()):
                if j == len(self._by_layer) - 1 and local == head_name and self._shares_head():
                    continue  # added below: the embedding's stored tensor itself
                read[local] = self.reader.get(hf_name).to(dtype)
            values: dict[str, Stored] = {
                local: quantize(t, group_size=64, dim=0)
                if compress and model.is_compressible(j, local, t)
                else t
                for local, t in model.fuse(read).items()
            }
            layer = self._home(j, self.tiers[j], values)
            if j == len(self._by_layer) - 1 and self._shares_head():
                layer.values[head_name] = self.layers[embed_j].values[embed_name]
            self.layers.append(layer)
            if progress is not None:
                progress(j + 1, model.num_layers)

    def _home(self, j: int, tier: str, values: dict[str, Stored]) -> StoredLayer:
        if tier == "gpu":
            moved = {
                k: _rebuild(v, [self.device.to_device(p) for p in _parts(v)])
                for k, v in values.items()
            }
            if self.prepack:
                moved = {
                    k: prepack(v)
                    if isinstance(v, torch.Tensor) and self.model.is_compressible(j, k, v)
                    else v
                    for k, v in moved.items()
                }
            return StoredLayer(tier, moved, nbytes=sum(nbytes_of(v) for v in moved.values()))
        if tier == "cpu":
            pinned = {}
            for k, v in values.items():
                parts = []
                for p in _parts(v):
                    host = self.device.host_empty(tuple(p.shape), p.dtype)
                    parts.append(host.copy_(p))
                pinned[k] = _rebuild(v, parts)
            return StoredLayer(tier, pinned, nbytes=sum(nbytes_of(v) for v in pinned.values()))
        f = self.disk.open(f"weights-{j:04d}.bin")
        offsets, offset, end = [], 0, 0
        for v in values.values():
            for p in _parts(v):
                offsets.append(offset)
                self.disk.write(f, offset, p)
                end = offset + p.numel() * p.element_size()
                offset = -(-end // _ALIGN) * _ALIGN
        f.drop_cache()
        meta = {k: _rebuild(v, [p.to("meta") for p in _parts(v)]) for k, v in values.items()}
        self._staging_bytes = max(self._staging_bytes, end)
        return StoredLayer(tier, meta, f, offsets, end)

    def is_resident(self, j: int) -> bool:
        """Layer j is used where it lies: on the compute device, uncompressed (its `load`
        moves and decodes nothing)."""
        return self.tiers[j] == "gpu" and not self.compress

    def bytes_per_tier(self) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for layer in self.layers:
            out[layer.tier] += layer.nbytes
        return out

    def load(self, j: int) -> Ready[Weights]:
        """Layer j's weights on the compute device, dequantized. Runs on a copy thread; on CUDA
        the copies go on this thread's side stream and the returned event fences them."""
        layer = self.layers[j]
        with self.device.on_copy_stream():
            if layer.tier == "gpu":
                values = layer.values
            elif layer.tier == "cpu":
                values = {
                    k: _rebuild(v, [self.device.to_device(p) for p in _parts(v)])
                    for k, v in layer.values.items()
                }
            else:
                values = self._load_disk(layer)
            weights = {
                k: dequantize(v) if isinstance(v, QuantizedTensor) else v for k, v in values.items()
            }
            return Ready(weights, self.device.record())

    def _load_disk(self, layer: StoredLayer) -> dict[str, Stored]:
        assert layer.file is not None
        if self.device.is_cuda:  # pinned staging buffers, recycled once the copy has landed
            try:
                staging = self._staging.get_nowait()
            except queue.Empty:
                staging = self.device.host_empty((self._staging_bytes,), torch.uint8)
        else:
            staging = torch.empty(layer.nbytes, dtype=torch.uint8)
        buf = staging[: layer.nbytes]
        self.disk.read(layer.file, 0, buf)
        values, i = {}, 0
        for k, template in layer.values.items():
            parts = []
            for p in _parts(template):
                n = p.numel() * p.element_size()
                host = buf[layer.offsets[i] : layer.offsets[i] + n].view(p.dtype).view(p.shape)
                parts.append(self.device.to_device(host))
                i += 1
            values[k] = _rebuild(template, parts)
        if self.device.is_cuda:
            done = self.device.record()
            assert done is not None
            done.synchronize()  # the device copies read `staging`; only then may it be reused
            self._staging.put(staging)
        return values
