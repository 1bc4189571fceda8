"""Thread-level parallelism control (LM-Offload Sec. 4.2, Algorithm 3): intra-op threads for
compute and the load, store and disk pools for a chosen policy, from the machine's core count
and the cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policy.cost_model import compressed_bytes_per_element, estimate
from policy.hardware import HardwareSpec
from policy.moe import cpu_expert_break_even, expected_distinct_experts
from policy.policy import Policy
from policy.specs import ModelSpec, WorkloadSpec

LOAD_TASKS: tuple[str, ...] = ("load_weight", "load_cache", "load_activation")
"""Tasks of the engine's load pool (BlockPipeline's load threads)."""
STORE_TASKS: tuple[str, ...] = ("store_cache", "store_activation")
"""Tasks of the engine's store pool."""
IO_TASKS: tuple[str, ...] = LOAD_TASKS + STORE_TASKS
"""The five load/store tasks that run beside compute; each needs at least one thread."""
MAX_COPY_THREADS = 16
"""Beyond this the copy pool only adds contention (disk queues are already full)."""
IMPROVEMENT = 1.01
"""A larger intra-op count must raise predicted throughput by 1% to be chosen."""


@dataclass(frozen=True)
class ThreadPlan:
    """Thread counts for the engine, with each load/store task's share."""

    num_cpu_threads: int
    """Intra-op threads of the compute task (torch.set_num_threads)."""
    num_load_threads: int
    """The load pool: the load tasks' shares together."""
    num_store_threads: int
    """The store pool: the store tasks' shares together."""
    io_threads: dict[str, int]
    """Each load/store task's share, in proportion to the bytes it moves."""

    @property
    def num_copy_threads(self) -> int:
        """The disk pool, which splits large reads and writes of both pools into chunks."""
        return min(MAX_COPY_THREADS, self.num_load_threads + self.num_store_threads)

    @classmethod
    def of(cls, intra_op: int, io_threads: dict[str, int]) -> ThreadPlan:
        load = sum(io_threads[t] for t in LOAD_TASKS)
        return cls(intra_op, load, sum(io_threads[t] for t in STORE_TASKS), io_threads)


def io_volumes(
    model: ModelSpec,
    workload: WorkloadSpec,
    policy: Policy,
    hardware: HardwareSpec | None = None,
) -> dict[str, float]:
    """Bytes each load/store task moves per layer per decode step (tier crossings only);
    `hardware` sets the CPU expert break-even of an MoE model (None: experts are copied)."""
    bls, dtype = policy.block_size, model.dtype_bytes
    packed = compressed_bytes_per_element(dtype) / dtype
    ratio = packed if policy.compress_weights else 1.0
    expert_bytes = model.total_expert_params * dtype
    layer_bytes = (model.total_weight_bytes - expert_bytes) / model.num_layers * ratio
    kv_tok = model.kv_bytes_per_token_per_layer * (packed if policy.compress_kv else 1.0)
    _, wc, wd = policy.weights_frac
    _, cc, cd = policy.kv_frac
    _, hc, hd = policy.act_frac
    # With CPU attention the CPU-homed cache never crosses PCIe; disk-homed still loads.
    moved_kv = cd if policy.cpu_attention else cc + cd
    act = (hc + hd) * bls * model.hidden_bytes_per_token
    # Routed experts: those a decode step's block touches, unless homed on the GPU or computed
    # on the CPU below the break-even (policy/moe.py).
    _, ec, ed = policy.experts_frac
    tokens = bls * model.num_experts_per_tok
    distinct = expected_distinct_experts(model.num_experts, model.num_experts_per_tok, bls)
    on_cpu = (
        hardware is not None
        and policy.cpu_experts
        and model.is_moe
        and tokens / distinct
        <= cpu_expert_break_even(model, hardware, policy.num_cpu_threads, policy.compress_weights)
    )
    experts = model.moe_layer_share * distinct * model.expert_weight_bytes * ratio
    kv_tok *= model.kv_layer_share  # a hybrid's KV is in its attention layers only
    return {
        "load_weight": (wc + wd) * layer_bytes + (ed + (0.0 if on_cpu else ec)) * experts,
        "load_cache": moved_kv
        * bls
        * model.attended_len(workload.prompt_tokens(model) + workload.gen_len / 2)
        * kv_tok,
        "load_activation": act,
        "store_cache": moved_kv * bls * kv_tok,
        "store_activation": act,
    }


def split_threads(num_threads: int, volumes: dict[str, float]) -> dict[str, int]:
    """At least one thread per task, the rest in proportion to bytes (largest remainder)."""
    shares = {task: 1 for task in volumes}
    spare = num_threads - len(volumes)
    total = sum(volumes.values())
    if spare <= 0 or total <= 0:
        return shares
    exact = {task: spare * volume / total for task, volume in volumes.items()}
    for task in volumes:
        shares[task] += int(exact[task])
    leftover = spare - sum(int(v) for v in exact.values())
    for task in sorted(volumes, key=lambda t: exact[t] - int(exact[t]), reverse=True)[:leftover]:
        shares[task] += 1
    return shares


def max_compute_threads(hardware: HardwareSpec) -> int:
    """The most intra-op threads Algorithm 3 can give compute on this machine; the search
    prices CPU attention at this count, and `choose_threads` then picks at or below it."""
    if hardware.compute_device == "cpu" or hardware.cpu_cores < 1 + len(IO_TASKS):
        return hardware.cpu_cores
    return hardware.cpu_cores - len(IO_TASKS)


def choose_threads(
    model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, policy: Policy
) -> ThreadPlan:
    """Algorithm 3: enumerate intra-op threads for compute, give the rest to load/store.

    LM-Offload also runs the CPU attention's independent ops concurrently (inter-op
    threads); our CPU attention is one fused SDPA call, so there is nothing to run beside
    it and compute is a single task of `intra_op` threads."""
    max_threads = hardware.cpu_cores
    volumes = io_volumes(model, workload, policy, hardware)
    uses_disk = policy.weights_frac[2] + policy.kv_frac[2] + policy.act_frac[2] > 0
    if hardware.compute_device == "cpu" or max_threads < 1 + len(IO_TASKS):
        # Too few cores to reserve one per load/store task (or the CPU does all the compute):
        # compute gets every core, copies share a few threads that mostly wait on I/O.
        shares = dict.fromkeys(IO_TASKS, 0)
        shares["load_weight"] = 2 if uses_disk else 1
        shares["store_cache"] = 1
        return ThreadPlan.of(max_threads, shares)
    best: tuple[float, ThreadPlan] | None = None
    for intra_op in range(1, max_threads - len(IO_TASKS) + 1):
        io_threads = split_threads(max_threads - intra_op, volumes)
        candidate = dataclasses.replace(policy, num_cpu_threads=intra_op)
        throughput = estimate(candidate, model, workload, hardware).generation_throughput
        if best is None or throughput > best[0] * IMPROVEMENT:
            best = (throughput, ThreadPlan.of(intra_op, io_threads))
    assert best is not None  # intra_op = 1 leaves >= 5 threads free (checked above)
    return best[1]


def plan_threads(
    model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, policy: Policy
) -> Policy:
    """`policy` with the thread counts of `choose_threads` filled in."""
    plan = choose_threads(model, workload, hardware, policy)
    return dataclasses.replace(
        policy,
        num_cpu_threads=plan.num_cpu_threads,
        num_load_threads=plan.num_load_threads,
        num_store_threads=plan.num_store_threads,
        num_copy_threads=plan.num_copy_threads,
    )
