"""The frozen `Policy` record: where tensors live and how a block is shaped."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from base.errors import UserError
from policy.jsonfile import parse_object, read_text

Triple = tuple[float, float, float]
TIERS: tuple[str, str, str] = ("gpu", "cpu", "disk")
NUM_NANO_BATCHES: tuple[int, ...] = (1, 2, 4)
"""The nano-batch counts the engine runs and the search weighs (NanoFlow splits in 2 and 4)."""
VISION_TIERS: tuple[str, ...] = ("gpu", "cpu")
"""Where a vision model's tower may be homed and run: the compute device, or the host."""


class PolicyError(UserError, ValueError):
    """A policy that cannot be used as written (bad fraction, bad size, bad file)."""


def _as_triple(name: str, value: Any) -> Triple:
    try:
        triple = tuple(float(x) for x in value)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{name} must be three numbers (gpu, cpu, disk), got {value!r}") from e
    if len(triple) != 3:
        raise PolicyError(f"{name} must be three numbers (gpu, cpu, disk), got {value!r}")
    if any(x < 0.0 or x > 1.0 for x in triple):
        raise PolicyError(f"{name} fractions must lie in [0, 1], got {triple}")
    if abs(sum(triple) - 1.0) > 1e-6:
        raise PolicyError(f"{name} must sum to 1, got {triple} (sum {sum(triple):.6f})")
    return (triple[0], triple[1], triple[2])


@dataclass(frozen=True)
class Policy:
    """How the engine runs one model on one machine (FlexGen Sec. 4, NanoFlow 4.3).

    A block of `gpu_batch_size * num_gpu_batches` sequences is processed layer by
    layer: each layer's weights are loaded once and used by every GPU batch.
    Each `*_frac` field is a (gpu, cpu, disk) triple summing to 1.
    """

    gpu_batch_size: int = 8
    """Sequences computed together in one kernel launch."""
    num_gpu_batches: int = 1
    """GPU batches per block; weights of a layer are loaded once per block."""
    weights_frac: Triple = (1.0, 0.0, 0.0)
    """Fraction of weight bytes homed on each tier, placed at layer granularity."""
    kv_frac: Triple = (1.0, 0.0, 0.0)
    """Fraction of sequences whose KV cache is homed on each tier."""
    act_frac: Triple = (1.0, 0.0, 0.0)
    """Fraction of sequences whose between-layer activations are homed on each tier."""
    experts_frac: Triple = (1.0, 0.0, 0.0)
    """MoE models: fraction of each MoE layer's routed experts homed on each tier, the
    most-routed first on the GPU (weights_frac then places everything else: attention,
    router, shared expert, embeddings). Dense models: (1, 0, 0), unused."""
    cpu_experts: bool = False
    """MoE models: a routed expert homed on the CPU is computed there when fewer tokens are
    routed to it than the cost model's break-even (`policy.moe.cpu_expert_break_even`)."""
    cpu_attention: bool = False
    """Decode attention over CPU-homed KV runs on the CPU (only q and new k, v move)."""
    compress_weights: bool = False
    """Store weights group-wise 4-bit quantized (group 64), dequantized before use."""
    compress_kv: bool = False
    """Store the KV cache group-wise 4-bit quantized (group 64)."""
    overlap: bool = True
    """Overlap loads and stores with compute; False runs the sequential reference loop."""
    num_nano_batches: int = 1
    """Nano-batches per GPU batch: inside each decoder layer the attention of one overlaps
    the dense ops of the others (NanoFlow 4.3); 1, 2 or 4, and 1 is off."""
    num_load_threads: int = 2
    """Threads that load weights, past KV and activations beside compute (LM-Offload
    Algorithm 3 sizes them by the bytes each load task moves)."""
    num_store_threads: int = 1
    """Threads that store new KV and activations beside compute."""
    num_copy_threads: int = 4
    """Threads of the disk pool, which splits large disk reads and writes into chunks."""
    num_cpu_threads: int = 0
    """torch intra-op threads for CPU compute; 0 keeps torch's default."""
    vision_tier: str = "gpu"
    """A vision model's tower (weights, encoded-image cache, its runs): "gpu", resident on the
    compute device, or "cpu", homed and run in host memory, its features copied to the
    device (policy/vision_cost.py); text models: "gpu", unused."""

    def __post_init__(self) -> None:
        for name in ("weights_frac", "kv_frac", "act_frac", "experts_frac"):
            object.__setattr__(self, name, _as_triple(name, getattr(self, name)))
        positive = ("gpu_batch_size", "num_gpu_batches", "num_nano_batches")
        threads = ("num_load_threads", "num_store_threads", "num_copy_threads")
        for name in (*positive, *threads):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PolicyError(f"{name} must be a positive integer, got {value!r}")
        value = self.num_cpu_threads
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PolicyError(f"num_cpu_threads must be an integer >= 0, got {value!r}")
        if self.vision_tier not in VISION_TIERS:
            raise PolicyError(f"vision_tier must be 'gpu' or 'cpu', got {self.vision_tier!r}")
        if self.num_nano_batches not in NUM_NANO_BATCHES:
            raise PolicyError(f"num_nano_batches must be 1, 2 or 4, got {self.num_nano_batches}")
        if self.num_nano_batches > self.gpu_batch_size:
            raise PolicyError(
                f"num_nano_batches ({self.num_nano_batches}) cannot exceed "
                f"gpu_batch_size ({self.gpu_batch_size})"
            )

    @property
    def block_size(self) -> int:
        """Sequences in one block: gpu_batch_size x num_gpu_batches."""
        return self.gpu_batch_size * self.num_gpu_batches

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"unknown policy field(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Policy:
        data = parse_object(text, "policy", PolicyError)
        if isinstance(data.get("policy"), dict):  # accept `nanoflex plan --json` output
            data = data["policy"]
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        return cls.from_json(read_text(path, "policy file", PolicyError))
