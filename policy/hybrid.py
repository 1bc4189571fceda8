"""Hybrid models' state layers in the cost model: `StateShape` and reading it from a config.

A hybrid (Qwen3-Next, Qwen3.5: Gated DeltaNet; Granite 4 hybrid, Nemotron-H: Mamba-2) mixes
tokens in most layers through a fixed-size state per sequence instead of attention over KV
pages (Falcon-H1, a parallel hybrid: in every layer, beside attention over KV pages): the short
convolution's last kernel - 1 inputs (conv channels x (kernel - 1), in the model dtype) and the
recurrent state (heads x key dim x value dim, float32, as transformers and the engine keep it:
engine/models/config.py `state_bytes`). The engine keeps a sequence's state beside its KV: on
the gpu tier for sequences whose KV is there, in host memory for the others (disk-homed ones
too: engine/core/state_slots.py), and every step reads it onto the compute device and writes it
back, once per state layer, for a decode and for a prefill chunk alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy.errors import ModelSpecError

RECURRENT_BYTES = 4
"""The recurrent state is float32 whatever the model dtype."""
DECODE_FLOPS_PER_ELEMENT = 8.0
"""A decode's recurrent step per state element: the delta rule decays the state, reads it
with k and with q and adds a rank-one update (4 multiply-adds; Mamba-2's 3 rounded up)."""
GATED_DELTA_CHUNK = 64
"""Tokens per chunk of the chunked delta rule (transformers' chunk_size), as the engine runs it
(engine/models/gated_delta.py) and the cost model prices it."""

STATE_KINDS = frozenset({"linear_attention", "mamba", "M"})
"""A layer kind whose token mixer keeps a state (transformers' names and Nemotron-H's pattern
letter)."""
ATTENTION_KINDS = frozenset({"full_attention", "attention", "*"})
MLP_KINDS = frozenset({"mlp", "-"})
MOE_KINDS = frozenset({"moe", "E"})
"""Nemotron 3's MoE layers: routed experts beside a shared MLP, no token mixer."""
PARALLEL_KINDS = frozenset({"hybrid"})
"""Falcon-H1's one kind: attention and a Mamba-2 mixer side by side."""


@dataclass(frozen=True)
class StateShape:
    """One state layer's shapes: its mixer's parameters and one sequence's state.

    Gated DeltaNet: heads are the value heads, key_dim and value_dim their widths. Mamba-2:
    heads x head dim (value_dim) x state dim (key_dim, which B and C have).
    """

    mixer_params: int
    """Parameters of the token mixer (projections, convolution, per-head ones, gated norm)."""
    conv_channels: int
    conv_kernel: int
    heads: int
    key_dim: int
    value_dim: int
    chunk: int
    """Tokens per chunk of the chunked scan a prompt runs."""

    def __post_init__(self) -> None:
        for name in ("mixer_params", "conv_channels", "heads", "key_dim", "value_dim", "chunk"):
            if getattr(self, name) < 1:
                raise ModelSpecError(f"state layer {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ModelSpecError(f"state layer conv_kernel must be >= 2, got {self.conv_kernel}")

    @property
    def recurrent_elements(self) -> int:
        return self.heads * self.key_dim * self.value_dim

    def bytes_per_sequence(self, dtype_bytes: int) -> int:
        """One sequence's state in one layer: the convolution window in the model dtype and
        the recurrent state in float32."""
        conv = self.conv_channels * (self.conv_kernel - 1) * dtype_bytes
        return conv + self.recurrent_elements * RECURRENT_BYTES

    @property
    def decode_flops(self) -> float:
        """FLOPs of one decode token in one layer outside the projections: the convolution
        step and the recurrent step."""
        conv = 2 * self.conv_channels * self.conv_kernel
        return conv + DECODE_FLOPS_PER_ELEMENT * self.recurrent_elements

    @property
    def prefill_flops(self) -> float:
        """FLOPs of one prompt token in one layer outside the projections, chunked: its
        share of the products with the state (its output read from the state, its update
        written to it: 4 per state element) and the scores and values within its chunk
        (2 x chunk x (key + value dims) per head)."""
        conv = 2 * self.conv_channels * self.conv_kernel
        within = 2 * self.chunk * self.heads * (self.key_dim + self.value_dim)
        return conv + 4 * self.recurrent_elements + within


def layer_kinds(config: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    """Each layer's kind as the config names it: `layer_types` (Qwen3-Next, Qwen3.5, Granite
    4), `layers_block_type` or `hybrid_override_pattern` (Nemotron-H); else Qwen's default of
    a full attention layer every full_attention_interval layers, and Falcon-H1's 'hybrid'
    layers (its config class derives them, config.json need not list them)."""
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if not kinds and isinstance(config.get("hybrid_override_pattern"), str):
        kinds = list(config["hybrid_override_pattern"])
    if not kinds and model_type == "falcon_h1":
        kinds = ["hybrid"] * num_layers
    if not kinds and model_type.startswith("qwen3"):
        interval = int(config.get("full_attention_interval", 4))
        kinds = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ModelSpecError(f"{model_type}: its layer kinds do not list its {num_layers} layers")
    known = STATE_KINDS | ATTENTION_KINDS | MLP_KINDS | MOE_KINDS
    if model_type == "falcon_h1":  # its layers are all of its one kind, none of the others
        known = PARALLEL_KINDS
    unknown = sorted({str(k) for k in kinds} - known)
    if unknown:
        raise ModelSpecError(f"{model_type}: layer kinds {unknown} are not priced")
    return [str(k) for k in kinds]


def hybrid_fields(config: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """`ModelSpec` fields of a hybrid's layers: which are state layers (Falcon-H1: all, each
    beside attention), which, in Nemotron-H, MLP-only ones (dense or MoE) and the state
    layers' `StateShape`."""
    kinds = layer_kinds(config, model_type, num_layers)
    if model_type.startswith("qwen3"):
        state = _gated_delta_net(config)
    else:
        state = _mamba2(config, model_type)
    state_kinds = PARALLEL_KINDS | STATE_KINDS
    return dict(
        state_layer_ids=tuple(i for i, kind in enumerate(kinds) if kind in state_kinds),
        mlp_only_layer_ids=tuple(
            i for i, kind in enumerate(kinds) if kind in MLP_KINDS | MOE_KINDS
        ),
        state=state,
        parallel_hybrid=model_type == "falcon_h1",
    )


def _gated_delta_net(config: dict[str, Any]) -> StateShape:
    """Qwen3-Next's and Qwen3.5's: q, k, v, the output gate z and the per-head b and a
    projected from the hidden state, a depthwise convolution over q, k and v without bias,
    a decay and a time step per value head, a gated RMSNorm one value head wide, and the
    output projection."""
    hidden = int(config["hidden_size"])
    key_heads = int(config["linear_num_key_heads"])
    value_heads = int(config["linear_num_value_heads"])
    key_dim, value_dim = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    kernel = int(config["linear_conv_kernel_dim"])
    keys, values = key_heads * key_dim, value_heads * value_dim
    conv = 2 * keys + values
    params = (
        hidden * (2 * keys + 2 * values + 2 * value_heads)  # q, k, v, z; b, a
        + conv * kernel
        + 2 * value_heads  # dt_bias, A_log
        + value_dim  # the gated norm
        + values * hidden
    )
    return StateShape(
        mixer_params=params,
        conv_channels=conv,
        conv_kernel=kernel,
        heads=value_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        chunk=GATED_DELTA_CHUNK,
    )


_MAMBA_NAMES = dict(
    heads="mamba_n_heads",
    head_dim="mamba_d_head",
    state="mamba_d_state",
    groups="mamba_n_groups",
    kernel="mamba_d_conv",
    chunk="mamba_chunk_size",
    conv_bias="mamba_conv_bias",
    in_bias="mamba_proj_bias",
    out_bias="mamba_proj_bias",
)
"""Granite 4's `mamba_*` names, which Falcon-H1 shares but for out_proj's bias."""
_MAMBA_KEYS: dict[str, dict[str, str]] = {
    "granitemoehybrid": _MAMBA_NAMES,
    "falcon_h1": {**_MAMBA_NAMES, "out_bias": "projectors_bias"},
    "nemotron_h": dict(
        heads="mamba_num_heads",
        head_dim="mamba_head_dim",
        state="ssm_state_size",
        groups="n_groups",
        kernel="conv_kernel",
        chunk="chunk_size",
        conv_bias="use_conv_bias",
        in_bias="use_bias",
        out_bias="use_bias",
    ),
}
"""Each family's names for Mamba-2's shapes and biases (transformers' mixer classes)."""


def _mamba_inner(config: dict[str, Any], model_type: str, heads: int) -> tuple[int, int]:
    """(inner width, head dim): heads x head dim; Falcon-H1's inner width is mamba_d_ssm (its
    config class's 1024 when absent, mamba_expand x hidden when null) and its head dim may be
    'auto' (inner / heads)."""
    head_dim = config[_MAMBA_KEYS[model_type]["head_dim"]]
    if model_type != "falcon_h1":
        return heads * int(head_dim), int(head_dim)
    inner = config.get("mamba_d_ssm", 1024)
    if inner is None:
        inner = int(config.get("mamba_expand", 2)) * int(config["hidden_size"])
    head_dim = int(inner) // heads if head_dim == "auto" else int(head_dim)
    if heads * head_dim != int(inner):
        raise ModelSpecError(
            f"falcon_h1: mamba_d_ssm {inner} is not mamba_n_heads x mamba_d_head "
            f"({heads} x {head_dim})"
        )
    return int(inner), head_dim


def _mamba2(config: dict[str, Any], model_type: str) -> StateShape:
    """Mamba-2's: x, the gate z, B and C per group and a time step per head projected from the
    hidden state, a depthwise convolution over x, B and C, a decay, time step bias and skip
    per head, a gated RMSNorm over the inner width (Falcon-H1's only with mamba_rms_norm), and
    the output projection."""
    keys = _MAMBA_KEYS[model_type]
    hidden = int(config["hidden_size"])
    heads = int(config[keys["heads"]])
    inner, head_dim = _mamba_inner(config, model_type, heads)
    state, groups = int(config[keys["state"]]), int(config[keys["groups"]])
    kernel = int(config.get(keys["kernel"], 4))
    conv = inner + 2 * groups * state
    in_bias = bool(config.get(keys["in_bias"], False))
    out_bias = bool(config.get(keys["out_bias"], False))
    conv_bias = bool(config.get(keys["conv_bias"], True))
    norm = model_type != "falcon_h1" or bool(config.get("mamba_rms_norm", False))
    in_width = inner + conv + heads
    params = (
        hidden * in_width
        + (in_width if in_bias else 0)
        + conv * kernel
        + (conv if conv_bias else 0)
        + 3 * heads  # dt_bias, A_log, D
        + (inner if norm else 0)  # the gated norm
        + inner * hidden
        + (hidden if out_bias else 0)
    )
    return StateShape(
        mixer_params=params,
        conv_channels=conv,
        conv_kernel=kernel,
        heads=heads,
        key_dim=state,
        value_dim=head_dim,
        chunk=int(config.get(keys["chunk"], 256)),
    )
