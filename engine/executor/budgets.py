"""Each tier's byte budget, given or derived from the machine, and the KV pages it leaves."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.storage.device import Device
from policy import TIERS, Policy
from policy.errors import UserError

GPU_RESERVE_FRAC = 0.1
"""Share of the gpu budget kept for activations and workspace, never given to KV pages."""
STORE_WINDOW = 3
"""Copies of new KV rows to host memory the layer loop may run ahead of (`CopyWindow`, in
the block pipeline): the device holds at most this many GPU batches' layers of them, plus
the one being made (`stores_in_flight` reserves as much)."""
LOAD_WINDOW = 1
"""Computes that read what the layer loop loaded (weights decoded on the device, past KV,
activations) the loop may run ahead of the device (`CopyWindow`, in the block pipeline):
what a compute reads stays on the device until it has run, so the device holds the loads of
the batch computing, of this many queued before it and of the one prefetched: three (the
planner prices two, double buffering); unbounded, a host ahead of the device held every
layer's (OPT-6.7B's 96-sequence batches of
512 past tokens: 48 GiB, found by the rehearsal, engine/rehearsal.py)."""
DEVICE_SHARE = 0.9
"""Without --gpu-mem: this share of the device memory free at start."""
RAM_SHARE = 0.8
"""Without --cpu-mem: this share of the available RAM (both memory tiers on a CPU box)."""
DISK_SHARE = 0.9
"""Without --disk-mem: this share of the free disk under the offload directory."""


class MemoryBudgetError(UserError):
    """The policy places more on a tier than its budget allows."""


def derive_budgets(
    device: Device,
    offload_dir: Path,
    gpu_mem: int | None,
    cpu_mem: int | None,
    disk_mem: int | None,
    policy: Policy,
    moe: bool = False,
) -> dict[str, int]:
    """Each tier's byte budget: as given, else derived from the machine so that KV
    admission is never unbounded: the device's free memory (on CUDA), a share of the
    available RAM, a share of the free disk under the offload directory. On a CPU-only box
    the "gpu" tier is host memory too: the two memory tiers split one RAM share in
    proportion to how much of the weights, KV and activations (and, for a MoE model, `moe`,
    the routed experts) the policy puts on each."""
    import psutil

    ram = int(psutil.virtual_memory().available * RAM_SHARE)
    if device.is_cuda:
        free, _ = torch.cuda.mem_get_info(device.device)
        derived_gpu, derived_cpu = int(free * DEVICE_SHARE), ram
    else:
        fracs = [policy.weights_frac, policy.kv_frac, policy.act_frac]
        if moe:
            fracs.append(policy.experts_frac)
        on_gpu, on_cpu = sum(f[0] for f in fracs), sum(f[1] for f in fracs)
        derived_gpu = int(ram * on_gpu / (on_gpu + on_cpu)) if on_gpu + on_cpu else ram // 2
        derived_cpu = ram - derived_gpu
    derived_disk = int(shutil.disk_usage(offload_dir).free * DISK_SHARE)
    return {
        "gpu": derived_gpu if gpu_mem is None else gpu_mem,
        "cpu": derived_cpu if cpu_mem is None else cpu_mem,
        "disk": derived_disk if disk_mem is None else disk_mem,
    }


def cap_gpu_memory(device: Device, budget: int) -> None:
    """On CUDA, hold this process to the gpu budget (emulates a smaller card)."""
    if device.is_cuda:
        total = torch.cuda.get_device_properties(device.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device.device)


def check_budgets(placed: dict[str, int], budgets: dict[str, int]) -> None:
    """Refuse a placement whose weights alone exceed a tier's budget."""
    for tier, budget in budgets.items():
        if placed[tier] > budget:
            raise MemoryBudgetError(
                f"weights placed on {tier} take {placed[tier] / 2**30:.2f} GiB, over the "
                f"{budget / 2**30:.2f} GiB budget; lower weights_frac[{TIERS.index(tier)}]"
            )


def check_host_memory(placed: dict[str, int], device: Device) -> None:
    """Refuse weights the machine's RAM cannot hold: the cpu tier's, and on a CPU-only box
    the gpu tier's too (the "gpu" is host memory there)."""
    import psutil

    in_ram = placed["cpu"] + (0 if device.is_cuda else placed["gpu"])
    available = psutil.virtual_memory().available
    if in_ram > available * RAM_SHARE:
        raise MemoryBudgetError(
            f"the policy keeps {in_ram / 2**30:.1f} GiB of weights in host memory but only "
            f"{available / 2**30:.1f} GiB of RAM is available: put more of them on disk "
            "(weights_frac) or pass --cpu-mem/--gpu-mem so the planner does"
        )


def kv_capacity_pages(
    budgets: dict[str, int],
    placed: dict[str, int],
    page_bytes: int,
    in_flight: int = 0,
    workspace: int = 0,
) -> dict[str, int | None]:
    """KV pages each tier may hold: its budget less its weights (and, on the gpu tier, less
    the larger of GPU_RESERVE_FRAC of the budget and a step's `workspace`
    (`step_workspace_bytes`), and the `in_flight` bytes of `stores_in_flight`)."""
    out: dict[str, int | None] = {}
    for tier in TIERS:
        if tier == "gpu":
            reserve = max(GPU_RESERVE_FRAC * budgets[tier], workspace) + in_flight
        else:
            reserve = 0
        out[tier] = max(0, int((budgets[tier] - placed[tier] - reserve) // page_bytes))
    return out


def step_workspace_bytes(
    config: ModelConfig,
    itemsize: int,
    tokens: int,
    rows: int,
    dequantized_layer: int = 0,
) -> int:
    """Device bytes one step's compute holds at its peak beside the homed weights and KV,
    an upper bound the gpu tier keeps free of KV pages: `tokens` rows through one layer at
    once (the residual, its normed copy, and the larger of the attention's projections and
    output and the MLP's widest intermediates; a MoE layer's routed copies of its rows), the
    sampled `rows`' logits in the compute type, in float32 and their float32 softmax, and
    two `dequantized_layer`s (a 4-bit layer decoded beside the next one's). A flat 10% of a
    4 GiB budget did not hold OPT-125M's 1,024 rows of 50,272 logits on the H200
    (tests/engine/executor/test_budgets.py measures a step's buffers against it)."""
    c = config
    h, q_dim = c.hidden_size, c.num_heads * c.head_dim
    attention = c.kv_shape.row_dim + 2 * q_dim  # q, k, v, then the attention's output
    width = max(c.intermediate_size, c.shared_expert_intermediate_size)
    routed = c.num_experts_per_tok * (c.moe_intermediate_size + h) if c.num_experts else 0
    mlp = 3 * max(width, routed)  # gate and up (or fc1), then the activation's output
    per_token = (2 * h + max(attention, mlp)) * itemsize
    logits = rows * c.vocab_size * (itemsize + 2 * 4)
    return tokens * per_token + logits + 2 * dequantized_layer


def stores_in_flight(
    policy: Policy, step_tokens: int, num_layers: int, kv_row_bytes: int, act_row_bytes: int
) -> int:
    """Device bytes a step's stores to host memory can hold at once. A layer's new KV rows
    headed for the cpu or disk tier stay on the device until their copy to the host has run
    on the store stream; the layer loop runs at most `STORE_WINDOW` such copies ahead
    (`CopyWindow`), so `STORE_WINDOW` + 1 GPU batches' layers of rows are alive at once, each
    at most a GPU batch's share of the step (before the window, every layer of a step could
    be: the H200's OPT-6.7B run under 16 GiB ran out of memory with 2,048 tokens x 32 layers
    x 16 KiB, and a 49,152-token step would hold 25.8 GB). A layer's output rows headed for
    the host are stored on a store thread and may all be alive: every layer's. Zero when
    both stay on the device."""
    out = 0
    if policy.kv_frac[0] < 1.0:
        rows = -(-step_tokens // policy.num_gpu_batches)
        out += min(STORE_WINDOW + 1, num_layers * policy.num_gpu_batches) * rows * kv_row_bytes
    if policy.act_frac[0] < 1.0:
        out += step_tokens * num_layers * act_row_bytes
    return out
