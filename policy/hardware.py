"""`HardwareSpec`: the measured constants of one machine, cached as JSON by `nanoflex profile`."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from base.errors import UserError
from policy.jsonfile import parse_object, publish_file, read_text

# The keys every hardware file must have (FlexGen A.3's constants plus memory sizes).
REQUIRED_KEYS: tuple[str, ...] = (
    "gpu_mem_bytes",
    "cpu_mem_bytes",
    "disk_mem_bytes",
    "ctog_bw",
    "gtoc_bw",
    "dtoc_bw",
    "ctod_bw",
    "gpu_flops",
    "gpu_bmm_flops",
    "cpu_flops",
)

# Used only when a profile lacks a measurement (documented in docs/policy.md):
HBM_PER_LINK_BW = 20.0
"""GPU memory bandwidth assumed as this multiple of host->device bandwidth (T4: 320/16)."""
DRAM_PER_LINK_BW = 4.0
"""CPU memory bandwidth assumed as this multiple of host->device bandwidth."""
UNFUSED_DEQUANT_PASSES = 16
"""Full-width memory passes of an unfused (unpack, scale, shift, reshape) dequantization."""
CPU_ATTENTION_SATURATION_THREADS = 8
"""CPU attention stops scaling past ~8 intra-op threads (LM-Offload Fig. 5)."""
FLAT_GROWTH = 0.1
"""A dense step counts as flat (no dearer than the fastest) within this share of its time."""
MAX_SPREAD = 0.25
"""A profile whose noisiest measurement spreads wider than this (interquartile range over
median) is measured again: a constant known only within +-12% cannot hold a 25% prediction."""
MAX_ATTEMPTS = 3
"""A noisy quick profile is measured at most this many times in all (again in the background,
engine/profiling/requiet.py); the least noisy is kept (a busy machine stays busy: re-measuring
forever would not help)."""


BUSY_CORES = 0.5
"""A profile measured while other processes kept more than this many cores busy on average
is taken under load (`HardwareSpec.machine_load`, engine/profiling/load.py)."""
BUSY_STEAL = 0.1
"""... or while a hypervisor stole more than this share of the machine's time."""


class HardwareError(UserError, ValueError):
    """A hardware profile that is missing, unreadable or malformed."""


@dataclass(frozen=True)
class HardwareSpec:
    """One machine's capacities (bytes), bandwidths (bytes/s) and throughputs (FLOP/s).

    Optional fields default to 0 / empty, meaning "not measured": the cost model then
    derives them from the required ones (see the *_estimate methods).
    """

    gpu_mem_bytes: int
    cpu_mem_bytes: int
    disk_mem_bytes: int
    ctog_bw: float
    """Host (pinned) to device copy bandwidth."""
    gtoc_bw: float
    """Device to host (pinned) copy bandwidth."""
    dtoc_bw: float
    """Disk read bandwidth into host memory."""
    ctod_bw: float
    """Host memory to disk write bandwidth."""
    gpu_flops: float
    """Dense matmul throughput on the compute device (the model's dtype)."""
    gpu_bmm_flops: float
    """Batched matmul throughput on the compute device (attention shapes)."""
    cpu_flops: float
    """CPU matmul throughput with all cores."""
    num_cpu_cores: int = 0
    """Hardware threads usable by the engine; 0 = unknown (os.cpu_count() is used)."""
    gpu_mem_bw: float = 0.0
    """Device memory bandwidth (bytes/s); bounds decode matmuls and dequantization."""
    cpu_mem_bw: float = 0.0
    """Host memory bandwidth (bytes/s); bounds CPU-side dequantization."""
    cpu_attention_throughput: tuple[tuple[int, float], ...] = ()
    """Measured decode attention on the CPU: (intra-op threads, KV bytes/s) pairs."""
    dequant_throughput: float = 0.0
    """Group-wise 4-bit dequantization on the compute device, elements/s."""
    dense_step_table: tuple[tuple[int, float], ...] = ()
    """Measured dense work of one step: (token rows, seconds) of a reference layer's matmuls
    on the compute device; how far it stays flat sets the discrete batch sizes (NanoFlow
    4.2, `dense_flat_rows`)."""
    dense_step_params: int = 0
    """Parameters of the reference Llama layer `dense_step_table` timed (its dense operations
    through the engine's layer code: norms, projections, rotary, SwiGLU MLP, residuals); 0 =
    unknown, and the cost model prices dense ops from gpu_flops and gpu_mem_bw instead of the
    table."""
    prefill_attention_flops: float = 0.0
    """Causal attention of prefill chunks through the engine's ragged attention on the compute
    device, FLOP/s counted as 4 s^2 q per sequence (the padded square it computes); 0 = not
    measured (gpu_bmm_flops stands in)."""
    device_attention_bw: float = 0.0
    """Decode attention through the engine's path on the compute device (gather the past KV
    from the pool, pad, SDPA), KV bytes/s; 0 = not measured (the larger of the FLOP and
    memory bounds from gpu_bmm_flops and gpu_mem_bw stands in)."""
    packed_attention_bw: float = 0.0
    """Decode attention with every past key gathered into a padded copy for SDPA, KV bytes/s:
    how nano-batched steps read their KV (each nano-batch slices its sequences' rows out of a
    packed copy; only whole GPU batches read the pool in place). 0 = not measured
    (device_attention_bw stands in)."""
    io_compute_share_small: float = 0.0
    """When the compute device is the CPU: the share of its rate compute loses while the
    copy threads read the disk in small pieces (KV pages); 0 on a GPU."""
    io_compute_share_large: float = 0.0
    """The same for large reads and writes (weight layers, activations)."""
    nano_overlap_device: float | None = None
    """Share of the shorter of a dense matmul and a decode attention that disappears when the
    two run side by side on two CUDA streams (two threads where the compute device is the
    CPU), in [0, 1]; what nano-batching can hide (NanoFlow 4.3). None: not measured (0)."""
    nano_overlap_host: float | None = None
    """The same for a dense matmul on the compute device beside CPU attention on a CPU
    thread. None: not measured (0)."""
    copy_hidden: float | None = None
    """On CUDA: share of the shorter of a layer-sized host-to-device copy (from pinned memory,
    on a side stream) and GEMMs on the compute stream that disappears when the two run
    together, timed with CUDA events, in [0, 1]: how much of the zig-zag schedule's I/O
    hides behind compute. None: not measured, and the cost model takes FlexGen's max (all
    of it hidden). Not used where the compute device is the CPU (io_compute_share_* price
    what its copy threads take from compute there)."""
    layer_overhead_s: float = 0.0
    """Fixed seconds per layer per GPU batch, whatever its size (kernel launches, the
    engine's per-layer bookkeeping); measured by running one-token steps through the engine."""
    nano_batch_overhead_s: float = 0.0
    """Fixed seconds each nano-batch beyond the first adds to a decoder layer (its kernel
    launches, the hand-offs between streams or threads); measured through the engine like
    layer_overhead_s. 0: not measured, layer_overhead_s stands in (an upper bound)."""
    compute_device: str = "cuda"
    """'cuda', or 'cpu' when the compute device is the CPU (then "gpu" = compute memory)."""
    machine: str = ""
    """`policy.machine.machine_key()` of the machine it was measured on; "" = not recorded. A
    cached profile whose key is not this machine's is measured again."""
    spread: dict[str, float] = field(default_factory=dict)
    """Per measurement (named as the field it feeds): the interquartile range of its timed
    samples over their median; empty = not recorded."""
    attempts: int = 1
    """Profiles measured on this machine to get this one (a noisy quick profile is measured
    again in the background up to MAX_ATTEMPTS times in all)."""
    quick: bool = False
    """Measured with small sizes by the planner for a first automatic plan; False: by
    `nanoflex profile`, which retakes each noisy measurement itself and is only replaced on
    another machine."""
    machine_load: dict[str, float] = field(default_factory=dict)
    """What else ran while it was measured (engine/profiling/load.py): `others_cores` (cores
    other processes kept busy on average), `steal_share`, the load average before and after;
    empty = not recorded (measured before this was watched)."""
    notes: str = ""
    """Free text: device names, how and when it was measured."""

    def __post_init__(self) -> None:
        for name in REQUIRED_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise HardwareError(f"hardware {name} must be a number >= 0, got {value!r}")
        for name in ("ctog_bw", "gtoc_bw", "gpu_flops", "gpu_bmm_flops", "cpu_flops"):
            if getattr(self, name) <= 0:
                raise HardwareError(f"hardware {name} must be > 0")
        if self.compute_device not in ("cuda", "cpu"):
            raise HardwareError(
                f"compute_device must be 'cuda' or 'cpu', not {self.compute_device!r}"
            )
        for name in ("nano_overlap_device", "nano_overlap_host", "copy_hidden"):
            share = getattr(self, name)
            if share is not None and (
                isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1
            ):
                raise HardwareError(f"hardware {name} must be a share in [0, 1] or null")
        if not isinstance(self.spread, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and v >= 0
            for k, v in self.spread.items()
        ):
            raise HardwareError("hardware spread must map measurement names to numbers >= 0")
        if not isinstance(self.machine_load, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in self.machine_load.items()
        ):
            raise HardwareError("hardware machine_load must map names to numbers")
        for name, key, value in (
            ("cpu_attention_throughput", "threads", "bytes/s"),
            ("dense_step_table", "rows", "seconds"),
        ):
            object.__setattr__(self, name, _pairs(name, getattr(self, name), key, value))

    # ---- derived constants -------------------------------------------------------------

    @property
    def max_spread(self) -> tuple[str, float]:
        """The noisiest measurement and its spread (("", 0.0) when none was recorded)."""
        return max(self.spread.items(), key=lambda kv: kv[1], default=("", 0.0))

    def staleness(self, machine: str) -> str | None:
        """Why this profile cannot be planned from on the machine with key `machine`: it was
        measured elsewhere (or before keys were recorded); None if it can."""
        if self.machine != machine:
            return f"it was measured on another machine ({self.machine or 'unrecorded'})"
        return None

    def noise(self) -> str | None:
        """Why this profile should be measured again, in the background, though it can be
        planned from: a quick one measured too noisily, fewer than MAX_ATTEMPTS times; None if
        not (`nanoflex profile` retook its noisy measurements itself)."""
        name, spread = self.max_spread
        if self.quick and spread > MAX_SPREAD and self.attempts < MAX_ATTEMPTS:
            return f"its {name} measurement spread {spread:.0%} (more than {MAX_SPREAD:.0%})"
        return None

    @property
    def cpu_cores(self) -> int:
        return self.num_cpu_cores or os.cpu_count() or 1

    @property
    def gpu_mem_bw_estimate(self) -> float:
        return self.gpu_mem_bw or HBM_PER_LINK_BW * self.ctog_bw

    @property
    def cpu_mem_bw_estimate(self) -> float:
        return self.cpu_mem_bw or DRAM_PER_LINK_BW * self.ctog_bw

    def decode_attention_bw(self, num_nano_batches: int) -> float:
        """KV bytes/s of decode attention on the compute device as the engine reads it: in
        place through its kernels for whole GPU batches, packed for nano-batches; 0 when
        not measured."""
        if num_nano_batches > 1 and self.packed_attention_bw:
            return self.packed_attention_bw
        return self.device_attention_bw

    @property
    def under_load(self) -> bool:
        """Measured while other work ran (`machine_load`): its rates are the best samples of a busy
        machine and its overlap shares are not believed."""
        return (
            self.machine_load.get("others_cores", 0.0) > BUSY_CORES
            or self.machine_load.get("steal_share", 0.0) > BUSY_STEAL
        )

    @property
    def nano_overlap_device_estimate(self) -> float:
        """Measured on a quiet machine, else 0: the search never picks nano-batching on a guess,
        nor on a share a busy machine measured (two operations timed alone while a neighbour
        slows them, then together while it rests, come out as overlapping wholly)."""
        return 0.0 if self.under_load else self.nano_overlap_device or 0.0

    @property
    def copy_hidden_estimate(self) -> float:
        """The share of the shorter of copies and compute hidden when they overlap: measured
        on CUDA, else 1.0 (FlexGen's max; a CPU's copy threads are priced apart)."""
        if self.compute_device != "cuda" or self.copy_hidden is None:
            return 1.0
        return self.copy_hidden

    @property
    def nano_overlap_host_estimate(self) -> float:
        return 0.0 if self.under_load else self.nano_overlap_host or 0.0

    def describe(self) -> str:
        """One line: when and how it was measured, how noisy, and whether it is trusted."""
        kind = "quick" if self.quick else "full"
        name, spread = self.max_spread
        noisiest = f"noisiest {name} {spread:.0%}" if name else "spreads not recorded"
        busy = self.machine_load
        if not busy:
            load = "load not recorded"
        elif self.under_load:
            load = (
                f"UNDER LOAD (other processes kept {busy.get('others_cores', 0):.1f} cores "
                f"busy, {busy.get('steal_share', 0):.0%} stolen): overlap shares not "
                "believed, to be measured again once the machine is quiet"
            )
        else:
            load = f"quiet (others {busy.get('others_cores', 0):.2f} cores)"
        return f"{self.notes or 'unnamed'}; {kind}, {noisiest}; {load}"

    @property
    def nano_batch_overhead_estimate(self) -> float:
        return self.nano_batch_overhead_s or self.layer_overhead_s

    def dequant_throughput_estimate(self, dtype_bytes: int) -> float:
        """Elements/s dequantized on the compute device: measured, else LM-Offload Eq. 16
        (3 FLOPs per element plus memory traffic) with unfused full-width passes."""
        if self.dequant_throughput:
            return self.dequant_throughput
        seconds_per_element = (
            3.0 / self.gpu_bmm_flops
            + UNFUSED_DEQUANT_PASSES * dtype_bytes / self.gpu_mem_bw_estimate
        )
        return 1.0 / seconds_per_element

    def cpu_attention_bw(self, num_threads: int, flops_per_kv_byte: float) -> float:
        """KV bytes/s that decode attention on the CPU consumes with `num_threads` (0 = all).

        From the measured table (linear between points, flat past the ends); else from
        cpu_flops and host memory bandwidth, scaling with threads up to saturation.
        """
        threads = num_threads or self.cpu_cores
        table = self.cpu_attention_throughput
        if table:
            if threads <= table[0][0]:
                return table[0][1] * threads / table[0][0]
            for (t0, bw0), (t1, bw1) in itertools.pairwise(table):
                if threads <= t1:
                    return bw0 + (bw1 - bw0) * (threads - t0) / (t1 - t0)
            return table[-1][1]
        full = min(self.cpu_flops / flops_per_kv_byte, self.cpu_mem_bw_estimate)
        saturation = min(self.cpu_cores, CPU_ATTENTION_SATURATION_THREADS)
        return full * min(threads, saturation) / saturation

    def dense_seconds(self, flops: float, weight_elems: float) -> float | None:
        """Seconds of dense matmuls doing `flops` over a layer of `weight_elems` parameters,
        from the measured table: the reference layer's time at the same number of rows
        (flops / 2 / weight_elems) scaled by weight_elems / dense_step_params, linear between
        measured rows, as the fewest rows below them and linear in rows past the most. None
        when the table or its reference size is missing."""
        table, ref = self.dense_step_table, self.dense_step_params
        if not table or not ref or weight_elems <= 0:
            return None
        # More rows never take less time (they could run padded to the next size), so each
        # entry is the least time of any row count at or above it: a spike at one size (a
        # descheduled thread on a busy machine) does not make it look slower than a larger one.
        table = tuple((rows, min(t for _, t in table[i:])) for i, (rows, _) in enumerate(table))
        rows = flops / (2 * weight_elems)
        if rows <= table[0][0]:
            ref_seconds = table[0][1]
        elif rows >= table[-1][0]:
            ref_seconds = table[-1][1] * rows / table[-1][0]
        else:
            (r0, t0), (r1, t1) = next(
                (a, b) for a, b in itertools.pairwise(table) if a[0] <= rows <= b[0]
            )
            ref_seconds = t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        return ref_seconds * weight_elems / ref

    def dense_flat_rows(self, growth: float = FLAT_GROWTH) -> int | None:
        """The most token rows, counting up from the fewest measured, whose dense step
        (`dense_step_table`) takes at most `growth` more than the fastest one (None when
        not measured): up to it the device is under-used, so padding rows cost nothing;
        beyond it time grows with the rows (a GPU stays flat to a hundred rows or more, a
        CPU to a few)."""
        if not self.dense_step_table:
            return None
        fastest = min(s for _, s in self.dense_step_table)
        flat = self.dense_step_table[0][0]
        for rows, seconds in self.dense_step_table:
            if seconds > (1 + growth) * fastest:
                break
            flat = rows
        return flat

    # ---- JSON --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["cpu_attention_throughput"] = [list(p) for p in self.cpu_attention_throughput]
        data["dense_step_table"] = [list(p) for p in self.dense_step_table]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise HardwareError(f"hardware profile lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HardwareError(
                f"unknown hardware field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> HardwareSpec:
        return cls.from_dict(parse_object(text, "hardware profile", HardwareError))

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file of this write's own, renamed), creating the
        directory: processes saving at once (the test workers) each write a whole file."""
        target = Path(path).expanduser()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            publish_file(target, self.to_json() + "\n")
        except OSError as e:
            raise HardwareError(f"cannot write hardware profile {target}: {e.strerror}") from e

    @classmethod
    def load(cls, path: str | Path) -> HardwareSpec:
        return cls.from_json(read_text(path, "hardware profile", HardwareError))


def _pairs(name: str, raw: Any, key: str, value: str) -> tuple[tuple[int, float], ...]:
    """A table of (int key >= 1, float value > 0) pairs, sorted by key."""
    try:
        table = tuple((int(k), float(v)) for k, v in raw)
    except (TypeError, ValueError) as e:
        raise HardwareError(f"{name} must be [{key}, {value}] pairs") from e
    if any(k < 1 or v <= 0 for k, v in table):
        raise HardwareError(f"{name} needs {key} >= 1 and {value} > 0")
    return tuple(sorted(table))


def default_cache_path() -> Path:
    """$NANOFLEX_CACHE/hardware.json if set, else ~/.cache/nanoflex/hardware.json."""
    root = os.environ.get("NANOFLEX_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "nanoflex"
    return base / "hardware.json"


def load_cached() -> HardwareSpec:
    """The profile `nanoflex profile` cached on this machine."""
    path = default_cache_path()
    if not path.is_file():
        raise HardwareError(
            f"no hardware profile at {path}; run `nanoflex profile` first (or pass --hardware FILE)"
        )
    return HardwareSpec.load(path)


GiB = 1024**3
# FlexGen's evaluation machine (GCP n1-highmem-32 + T4); derivation in docs/policy.md.
FLEXGEN_T4 = HardwareSpec(
    gpu_mem_bytes=16 * GiB,
    cpu_mem_bytes=208 * GiB,
    disk_mem_bytes=1500 * GiB,
    ctog_bw=12e9,
    gtoc_bw=12e9,
    dtoc_bw=1.6e9,
    ctod_bw=1.3e9,
    gpu_flops=40e12,
    gpu_bmm_flops=20e12,
    cpu_flops=1.0e12,
    num_cpu_cores=32,
    gpu_mem_bw=250e9,
    cpu_mem_bw=60e9,
    cpu_attention_throughput=((8, 6.5e9), (32, 6.5e9)),
    dequant_throughput=5e9,
    compute_device="cuda",
    notes="FlexGen paper machine: T4 16 GB, 208 GB DRAM, 1.5 TB SSD (see docs/policy.md)",
)
