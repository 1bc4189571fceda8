"""Each tier's byte budget, given or derived from the machine, and the KV pages it leaves."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from base.errors import UserError
from engine.storage.device import Device
from policy import TIERS, Policy
from policy.cost_model import USABLE_FRAC

GPU_RESERVE_FRAC = 1 - USABLE_FRAC["gpu"]
"""Share of the gpu budget never given to KV pages (the planner's: CUDA context,
fragmentation); on a GPU the planner's reserves come off besides (policy/reserves.py)."""
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
    gpu_reserve: int = 0,
) -> dict[str, int | None]:
    """KV pages each tier may hold: its budget less its weights and, on the gpu tier, less
    GPU_RESERVE_FRAC of its budget, the `in_flight` bytes of the slots offloaded layers load
    into (on the CPU) and `gpu_reserve`, what a step holds on a GPU as the planner prices it
    (policy/reserves.py: `gpu_reserves`). So a plan that fills the gpu tier gets the KV pages
    it priced, none taken by a reserve the planner did not see."""
    out: dict[str, int | None] = {}
    for tier in TIERS:
        reserve = GPU_RESERVE_FRAC * budgets[tier] + in_flight + gpu_reserve if tier == "gpu" else 0
        out[tier] = max(0, int((budgets[tier] - placed[tier] - reserve) // page_bytes))
    return out
