"""The profile's dense step table: one reference Llama layer's dense operations through the
engine's own layer code, timed at 1, 2, 4, ... token rows (where it stays flat sets NanoFlow
4.2's discrete sizes; the cost model's dense term)."""

from __future__ import annotations

import torch

from engine.kernels import dense_ops
from engine.models.base import Positions, Weights, can_prepack, prepack
from engine.models.config import ModelConfig
from engine.models.llama import LlamaModel
from engine.profiling.timing import Probe
from engine.storage.device import Device

HEAD_DIM = 64


def reference_layer(
    hidden: int, dtype: torch.dtype, where: torch.device
) -> tuple[LlamaModel, Weights]:
    """A Llama layer of width `hidden` (heads of 64, 4 query heads per KV head, SwiGLU MLP of
    8/3 hidden rounded to 64) with random weights on `where`."""
    heads = hidden // HEAD_DIM
    kv_heads = max(1, heads // 4)
    inter = (8 * hidden // 3 + 63) // 64 * 64
    config = ModelConfig(
        model_type="llama",
        vocab_size=1,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=1 << 16,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
    )
    shapes = {
        "q": (heads * HEAD_DIM, hidden),
        "k": (kv_heads * HEAD_DIM, hidden),
        "v": (kv_heads * HEAD_DIM, hidden),
        "o": (hidden, heads * HEAD_DIM),
        "gate": (inter, hidden),
        "up": (inter, hidden),
        "down": (hidden, inter),
    }
    w = {
        f"{n}.weight": torch.randn(s, dtype=dtype, device=where) / hidden**0.5
        for n, s in shapes.items()
    }
    w["ln1.weight"] = torch.ones(hidden, dtype=dtype, device=where)
    w["ln2.weight"] = torch.ones(hidden, dtype=dtype, device=where)
    model = LlamaModel(config)
    fused = model.fuse(w)
    if can_prepack(where, dtype):  # as the engine stores resident CPU weights by default
        fused = {k: prepack(t) if t.dim() == 2 else t for k, t in fused.items()}
    if where.type == "cpu":  # and runs the fused ops around them
        model.dense_ops = dense_ops()
    return model, fused


def dense_step_table(
    device: Device, dtype: torch.dtype, hidden: int, max_rows: int, probe: Probe
) -> tuple[tuple[tuple[int, float], ...], int]:
    """((token rows, seconds), ...) of the reference layer's dense work (norms, QKV and output
    projections, rotary, MLP, residuals: all but attention, as the engine runs them) for
    power-of-two row counts up to `max_rows`, and the layer's parameter count. Where its time
    starts to grow with the rows sets the discrete batch sizes (NanoFlow 4.2)."""
    model, w = reference_layer(hidden, dtype, device.device)
    params = sum(t.numel() for t in w.values() if t.dim() == 2)
    heads = model.config.num_heads
    table = []
    rows = 1
    while rows <= max_rows:
        h = torch.randn(rows, hidden, dtype=dtype, device=device.device)
        positions = model.positions(torch.arange(rows, device=device.device), dtype)
        o = torch.zeros(rows, heads, HEAD_DIM, dtype=dtype, device=device.device)

        def layer(
            h: torch.Tensor = h, positions: Positions = positions, o: torch.Tensor = o
        ) -> torch.Tensor:
            model.attention_inputs(1, w, h, positions)
            return model.attention_output(w, h, o)

        table.append((rows, probe.seconds("dense_step_table", layer, device)))
        rows *= 2
    return tuple(table), params
