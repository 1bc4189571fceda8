"""`WeightStore`: each layer homed on one tier, and each routed expert of a MoE layer on its own,
loaded onto the compute device on demand.

A MoE layer is stored as units: its other tensors (attention, norms, the router, a shared
expert) on the layer's tier, and every routed expert (`experts.<e>.*`) on the tier its place
in the experts' order gives it. The policy's weights_frac splits the layers' other bytes and
its experts_frac the experts' bytes, each to unit granularity. The experts' order is the
most-picked first (`ExpertPicks`, counted as the engine runs), so the GPU's share goes to the
experts the router uses most; `hot_experts=False` keeps index order (the ablation)."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.model_files import ModelLoadError
from engine.models.base import Model, Weights, can_prepack, prepack
from engine.models.moe import PICKS
from engine.storage.device import Device, Ready
from engine.storage.disk import DiskFile, DiskIO
from engine.storage.expert_picks import ExpertPicks
from engine.storage.quant import QuantizedTensor, dequantize, quantize
from engine.storage.weight_slots import ALIGN, WeightSlots, layout_of, offsets_of
from policy import TIERS

Stored = torch.Tensor | QuantizedTensor


class TensorReader(Protocol):
    """What the weight store reads: tensors by checkpoint name (engine.loading's readers)."""

    @property
    def names(self) -> list[str]: ...

    def numel(self, name: str) -> int: ...

    def get(self, name: str) -> torch.Tensor: ...


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


def _decoded(values: dict[str, Stored]) -> Weights:
    return {k: dequantize(v) if isinstance(v, QuantizedTensor) else v for k, v in values.items()}


def nbytes_of(value: Stored) -> int:
    return sum(p.numel() * p.element_size() for p in _parts(value))


@dataclass(slots=True)
class StoredLayer:
    """One unit of storage: a layer, or a MoE layer's other tensors with `experts` beside."""

    tier: str
    values: dict[str, Stored] = field(default_factory=dict)
    """gpu tier: on the compute device; cpu tier: host memory; disk tier: meta-only templates."""
    file: DiskFile | None = None
    offsets: list[int] = field(default_factory=list)
    """Disk tier: byte offset of each part from `start`, in `values` order then part order."""
    nbytes: int = 0
    start: int = 0
    """Disk tier: where the unit begins in `file` (a layer's units share its file)."""
    experts: dict[int, StoredLayer] = field(default_factory=dict)
    """A MoE layer's routed experts, each its own unit, by expert index."""

    def units(self) -> list[StoredLayer]:
        return [self, *self.experts.values()]


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


def expert_of(local: str) -> int | None:
    """The routed expert a local tensor name belongs to (`experts.<e>.<...>`), or None
    (stacked `experts.gate_up_proj` belongs to all: `fuse` splits it)."""
    if not local.startswith(EXPERTS_PREFIX):
        return None
    index = local[len(EXPERTS_PREFIX) :].split(".", 1)[0]
    return int(index) if index.isdigit() else None


class WeightStore:
    """Reads a checkpoint layer by layer, casts, optionally compresses, and homes each layer
    (and each routed expert)."""

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
        picks: ExpertPicks | None = None,
        hot_experts: bool = True,
    ) -> None:
        """Plans where each layer and expert goes (nothing is read yet: `planned_bytes` can
        be checked against the budgets first); `read_all` then reads and homes every layer.
        `prepack`: the compute device's uncompressed linear weights are stored prepacked
        for the CPU's GEMM (`engine.models.base.prepack`), where the CPU computes.
        `picks`: a MoE model's router counts, handed to each MoE layer's computation with
        its weights; with `hot_experts` the most-picked experts are homed first."""
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
        self._tied = head_name not in head and model.pooling is None  # a pooling head has none
        if self._tied:  # the head reads the embedding's tensor (shared when on one tier)
            if embed_name not in by_layer[embed_j]:
                raise ModelLoadError("checkpoint has neither an LM head nor token embeddings")
            head[head_name] = by_layer[embed_j][embed_name]
        for j, names in enumerate(by_layer):
            if not names:
                raise ModelLoadError(f"checkpoint has no tensors for layer {j}")
        sizes = [sum(self._bytes(k, n) for k, n in names.items()) for names in by_layer]
        expert_bytes = [
            sum(self._bytes(k, n) for k, n in names.items() if k.startswith(EXPERTS_PREFIX))
            for names in by_layer
        ]
        self.num_experts = model.config.num_experts
        self.tiers = assign_tiers(
            [s - e for s, e in zip(sizes, expert_bytes, strict=True)], weights_frac
        )
        """Each layer's home (a MoE layer's: of its tensors other than the routed experts)."""
        moe_layers = [j for j, e in enumerate(expert_bytes) if e]
        self.picks = picks
        order = [(j, e) for j in moe_layers for e in range(self.num_experts)]
        if picks is not None and hot_experts:  # most picked first; uncounted ones last
            rank = {unit: i for i, unit in enumerate(picks.hottest_first())}
            order.sort(key=lambda unit: rank.get(unit, len(rank)))
        self._expert_bytes = {j: expert_bytes[j] // max(self.num_experts, 1) for j in moe_layers}
        homes = assign_tiers(
            [self._expert_bytes[j] for j, _ in order], experts_frac or weights_frac
        )
        self.expert_tiers: list[dict[int, str]] = [{} for _ in by_layer]
        """Each MoE layer's routed experts' homes, by expert index."""
        for (j, e), tier in zip(order, homes, strict=True):
            self.expert_tiers[j][e] = tier
        self._sizes, self._by_layer = sizes, by_layer
        self.layers: list[StoredLayer] = []
        self._staging: queue.Queue[torch.Tensor] = queue.Queue()
        self._staging_bytes = 0
        self._files: dict[int, tuple[DiskFile, int]] = {}
        """Per layer with units on disk: its file and where the next unit goes."""
        self.slots: WeightSlots | None = None
        """Fixed buffers the offloaded layers are loaded into (`make_slots`)."""

    def planned_bytes(self) -> dict[str, int]:
        """Bytes each tier will hold once loaded, uncompressed (an upper bound with 4-bit)."""
        out = dict.fromkeys(TIERS, 0)
        for j, (tier, size) in enumerate(zip(self.tiers, self._sizes, strict=True)):
            out[tier] += size - self._expert_bytes.get(j, 0) * len(self.expert_tiers[j])
            for expert_tier in self.expert_tiers[j].values():
                out[expert_tier] += self._expert_bytes[j]
        if self._shares_head():
            out[self.tiers[-1]] -= self._sizes[-1] - self._head_only_bytes()
        return out

    def largest_layer_bytes(self) -> int:
        """The largest layer's bytes uncompressed (embeddings and head included): what one
        4-bit layer takes once decoded for its compute."""
        return max(self._sizes)

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
        return sum(self._bytes(k, n) for k, n in names.items() if k != head_name)

    def _bytes(self, local: str, hf_name: str) -> int:
        """Checkpoint tensor `hf_name`'s bytes as stored under local name `local`."""
        itemsize = self.model.stored_dtype(local, self.dtype).itemsize
        return self.reader.numel(hf_name) * itemsize

    def read_all(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Read, cast, compress and home every layer. On CUDA a tensor is compressed on the
        device (`quantize` is bit-identical there: tests/engine/storage/test_quant.py) and its
        4-bit parts homed from there: on the host, group-wise quantization of OPT-6.7B alone
        took the H200 pass's whole 131 s (the CPU's amin, amax and round over 6.7B numbers)."""
        model, dtype, compress = self.model, self.dtype, self.compress
        embed_j, embed_name, head_name = model.tied_head_source()
        for j, names in enumerate(self._by_layer):
            read: Weights = {}
            for local, hf_name in sorted(names.items()):
                if j == len(self._by_layer) - 1 and local == head_name and self._shares_head():
                    continue  # added below: the embedding's stored tensor itself
                read[local] = self.reader.get(hf_name).to(model.stored_dtype(local, dtype))
            values: dict[str, Stored] = {
                local: quantize(self.device.to_device(t), group_size=64, dim=0)
                if compress and model.is_compressible(j, local, t)
                else t
                for local, t in model.fuse(read).items()
            }
            layer = self._home(
                j, self.tiers[j], {k: v for k, v in values.items() if expert_of(k) is None}
            )
            for e, tier in sorted(self.expert_tiers[j].items()):
                mine = {k: v for k, v in values.items() if expert_of(k) == e}
                layer.experts[e] = self._home(j, tier, mine)
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
        if j not in self._files:  # a layer's units on disk share one file
            self._files[j] = (self.disk.open(f"weights-{j:04d}.bin"), 0)
        f, start = self._files[j]
        parts = [p.cpu() for v in values.values() for p in _parts(v)]  # from the device too
        offsets, end = offsets_of(
            tuple((str(i), tuple(p.shape), p.dtype) for i, p in enumerate(parts))
        )
        for p, offset in zip(parts, offsets, strict=True):
            self.disk.write(f, start + offset, p)
        f.drop_cache()
        self._files[j] = (f, start + -(-end // ALIGN) * ALIGN)
        meta = {k: _rebuild(v, [p.to("meta") for p in _parts(v)]) for k, v in values.items()}
        self._staging_bytes = max(self._staging_bytes, end)
        return StoredLayer(tier, meta, f, offsets, end, start)

    def is_resident(self, j: int) -> bool:
        """Layer j is used where it lies: on the compute device, uncompressed, its experts
        too (its `load` moves and decodes nothing)."""
        on_device = self.tiers[j] == "gpu" and all(
            tier == "gpu" for tier in self.expert_tiers[j].values()
        )
        return on_device and not self.compress

    def uses_tier(self, tier: str) -> bool:
        """Some layer or expert is homed on `tier`."""
        return tier in self.tiers or any(tier in homes.values() for homes in self.expert_tiers)

    def bytes_per_tier(self) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for layer in self.layers:
            for unit in layer.units():
                out[unit.tier] += unit.nbytes
        return out

    def make_slots(self) -> None:
        """Load offloaded decoder layers into fixed slots from now on (`WeightSlots`): those
        of a dense, uncompressed model that share the first one's layout; on the CPU only
        those on disk (host memory is where the CPU computes: a cpu-tier layer is used where
        it lies)."""
        if self.compress or any(self.expert_tiers):
            return
        offloaded = [
            j
            for j, layer in enumerate(self.layers)
            if self.model.layer_kind(j) == "decoder"
            and layer.tier != "gpu"
            and (self.device.is_cuda or layer.tier == "disk")
        ]
        if not offloaded:
            return
        layout = layout_of(self.layers[offloaded[0]].values)  # type: ignore[arg-type]
        same = [j for j in offloaded if layout_of(self.layers[j].values) == layout]  # type: ignore[arg-type]
        self.slots = WeightSlots(layout, same, self.device)

    def fixed_weights(self) -> list[Weights | None] | None:
        """Per layer, the tensors that hold its weights at the same addresses every step (what
        a CUDA graph may read): a resident layer's own, an offloaded layer's slot; None for
        an embedding or head that is neither (run eagerly). None when a decoder layer has
        no fixed address."""
        out: list[Weights | None] = []
        for j, layer in enumerate(self.layers):
            if self.is_resident(j):
                out.append(_decoded(layer.values))
            elif self.slots is not None and self.slots.holds(j):
                out.append(self.slots.weights(j))
            elif self.model.layer_kind(j) == "decoder":
                return None
            else:
                out.append(None)
        return out

    def release(self, j: int) -> None:
        """Layer j's compute has been enqueued (called on the compute stream's thread): its
        slot may be loaded again once that has run (`WeightSlots.release`, with an event
        recorded here; nothing for a layer without a slot)."""
        if self.slots is not None and self.slots.holds(j):
            self.slots.release(j, self.device.record())

    def load(self, j: int, experts: bool = True, host_experts: bool = True) -> Ready[Weights]:
        """Layer j's weights on the compute device, dequantized (a MoE layer's with its
        router counter, `PICKS`). `experts` False: of a MoE layer's routed experts only those
        homed on the device; `host_experts` False: all but those homed in host memory
        (`load_expert` fetches the others, or they run on the CPU). Runs on a copy thread; on
        CUDA the copies go on this thread's side stream and the returned event fences them."""
        layer = self.layers[j]
        if self.slots is not None and self.slots.holds(j):
            with self.device.on_copy_stream():
                self._load_into_slot(j, layer)
                return Ready(self.slots.weights(j), self.device.record())
        if experts:
            units = [layer, *(u for u in layer.experts.values() if host_experts or u.tier != "cpu")]
        else:
            units = [layer, *self.resident_experts(j).values()]
        with self.device.on_copy_stream():
            values: dict[str, Stored] = {}
            for unit in units:
                values.update(self._on_device(unit))
            weights = _decoded(values)
            if layer.experts and self.picks is not None:
                weights[PICKS] = self.picks.counts[j]
            return Ready(weights, self.device.record())

    def resident_experts(self, j: int) -> dict[int, StoredLayer]:
        """Layer j's routed experts homed on the device, uncompressed (used where they lie)."""
        if self.compress:
            return {}
        return {e: u for e, u in self.layers[j].experts.items() if u.tier == "gpu"}

    def load_expert(self, j: int, e: int) -> Ready[Weights]:
        """Routed expert e of layer j on the compute device, dequantized (as `load`)."""
        with self.device.on_copy_stream():
            values = self._on_device(self.layers[j].experts[e])
            return Ready(_decoded(values), self.device.record())

    def host_expert(self, j: int, e: int) -> Weights:
        """Routed expert e of layer j, homed in host memory, as it lies there (dequantized
        on the CPU if compressed): for running it on the CPU."""
        unit = self.layers[j].experts[e]
        assert unit.tier == "cpu", unit.tier
        return _decoded(unit.values)

    def _on_device(self, unit: StoredLayer) -> dict[str, Stored]:
        if unit.tier == "gpu":
            return unit.values
        if unit.tier == "cpu":
            return {
                k: _rebuild(v, [self.device.to_device(p) for p in _parts(v)])
                for k, v in unit.values.items()
            }
        return self._load_disk(unit)

    def _load_into_slot(self, j: int, layer: StoredLayer) -> None:
        """Layer j's weights copied into its slot: from host memory tensor by tensor; from
        disk in one read (on the CPU straight into the slot; on CUDA into pinned staging,
        then one copy)."""
        assert self.slots is not None
        if layer.tier == "cpu":
            self.slots.fill(j, layer.values)  # type: ignore[arg-type]
            return
        assert layer.file is not None
        if not self.device.is_cuda:
            self.disk.read(layer.file, layer.start, self.slots.target(j)[: layer.nbytes])
            return
        staging = self._take_staging()
        self.disk.read(layer.file, layer.start, staging[: layer.nbytes])
        self.slots.fill(j, staging[: layer.nbytes])
        self._recycle_staging(staging)

    def _take_staging(self) -> torch.Tensor:
        """A pinned staging buffer for a disk layer on its way to the GPU."""
        try:
            return self._staging.get_nowait()
        except queue.Empty:
            return self.device.host_empty((self._staging_bytes,), torch.uint8)

    def _recycle_staging(self, staging: torch.Tensor) -> None:
        done = self.device.record()
        assert done is not None
        done.synchronize()  # the device copies read `staging`; only then may it be reused
        self._staging.put(staging)

    def _load_disk(self, layer: StoredLayer) -> dict[str, Stored]:
        assert layer.file is not None
        if self.device.is_cuda:  # pinned staging buffers, recycled once the copy has landed
            staging = self._take_staging()
        else:
            staging = torch.empty(layer.nbytes, dtype=torch.uint8)
        buf = staging[: layer.nbytes]
        self.disk.read(layer.file, layer.start, buf)
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
            self._recycle_staging(staging)
        return values
