"""transformers parameters that llama.cpp's converter split, stacked or transposed, rebuilt from
their GGUF tensors: each layer's experts (stacked per projection, (experts, out, in); gpt-oss and
Llama 4 hold theirs transposed, (experts, in, out), gpt-oss with gate and up interleaved along
the output), and DeepSeek's kv_b_proj, which llama.cpp's converter since April 2025 writes as
per-head `attn_k_b` (heads, kv_lora_rank, qk_nope, transposed) and `attn_v_b` (heads, v_head,
kv_lora_rank) for its absorbed MLA; older files keep `attn_kv_b` whole and need no join."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]

EXPERT_TENSOR = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.(?:mlp|feed_forward)\.experts\."
    r"(gate_up_proj|down_proj)(_bias)?$"
)
"""transformers' stacked experts of a layer: groups (layer, tensor, bias or not)."""
KV_B = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.kv_b_proj\.weight$")
TRANSPOSED_EXPERTS = {"gpt-oss": "interleaved", "llama4": "halves"}
"""Architectures whose transformers experts are (experts, in, out): how gate and up share the
output dimension of gate_up_proj (gpt-oss alternates them, Llama 4 puts gate first)."""


@dataclass(frozen=True, slots=True)
class Join:
    """A parameter made from several GGUF tensors, or from one rearranged: their names, the
    parameter's shape from theirs (torch's order), and the parameter from their values."""

    sources: tuple[str, ...]
    shape: Callable[[list[Shape]], Shape]
    build: Callable[[list[np.ndarray]], np.ndarray]


def find_join(name: str, arch: str, present: set[str]) -> Join | None:
    """The join that makes transformers' parameter `name` from the file's tensors (`present`),
    or None where one GGUF tensor is the parameter as it is."""
    experts = EXPERT_TENSOR.match(name)
    if experts is not None:
        block, tensor, bias = experts.groups()
        return _experts(f"blk.{block}", tensor, "bias" if bias else "weight", arch)
    kv_b = KV_B.match(name)
    if kv_b is not None and f"blk.{kv_b.group(1)}.attn_kv_b.weight" not in present:
        split = (f"blk.{kv_b.group(1)}.attn_k_b.weight", f"blk.{kv_b.group(1)}.attn_v_b.weight")
        if split[0] in present:
            return Join(split, _kv_b_shape, _kv_b)
    return None


def _experts(prefix: str, tensor: str, kind: str, arch: str) -> Join:
    layout = TRANSPOSED_EXPERTS.get(arch)
    if tensor == "down_proj":
        down = (f"{prefix}.ffn_down_exps.{kind}",)
        if layout is None or kind == "bias":
            return Join(down, lambda shapes: shapes[0], lambda arrays: arrays[0])
        return Join(down, lambda s: (*s[0][:-2], s[0][-1], s[0][-2]), _transposed)
    gate_up = (f"{prefix}.ffn_gate_exps.{kind}", f"{prefix}.ffn_up_exps.{kind}")
    if layout is None:  # (experts, gate + up, in): concatenated along the output dimension
        return Join(gate_up, _stacked_shape, lambda arrays: np.concatenate(arrays, axis=1))
    if kind == "bias":  # (experts, out) each; only gpt-oss has expert biases
        return Join(gate_up, lambda s: (s[0][0], 2 * s[0][1]), _interleaved_bias)
    build = _interleaved if layout == "interleaved" else _halves
    return Join(gate_up, lambda s: (s[0][0], s[0][2], 2 * s[0][1]), build)


def _stacked_shape(shapes: list[Shape]) -> Shape:
    return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])


def _transposed(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0].swapaxes(-1, -2)


def _halves(arrays: list[np.ndarray]) -> np.ndarray:
    """(experts, out, in) gate and up -> (experts, in, gate + up)."""
    return np.concatenate([a.swapaxes(-1, -2) for a in arrays], axis=-1)


def _interleaved(arrays: list[np.ndarray]) -> np.ndarray:
    """(experts, out, in) gate and up -> (experts, in, 2 out), gate in the even columns."""
    gate, up = (a.swapaxes(-1, -2) for a in arrays)
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def _interleaved_bias(arrays: list[np.ndarray]) -> np.ndarray:
    return np.stack(arrays, axis=-1).reshape(arrays[0].shape[0], -1)


def _kv_b_shape(shapes: list[Shape]) -> Shape:
    (heads, rank, nope), (_, v_head, _) = shapes
    return (heads * (nope + v_head), rank)


def _kv_b(arrays: list[np.ndarray]) -> np.ndarray:
    """(heads, rank, nope) k_b and (heads, v_head, rank) v_b -> kv_b_proj's (heads * (nope +
    v_head), rank): per head its key rows, then its value rows."""
    k_b, v_b = arrays
    return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
