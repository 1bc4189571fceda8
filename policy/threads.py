"""Thread-level parallelism control (LM-Offload Sec. 4.2, Algorithm 3): intra-op, inter-op
and copy threads for a chosen policy, from the machine's core count and the cost model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policy.cost_model import compressed_bytes_per_element, estimate
from policy.hardware import HardwareSpec
from policy.policy import Policy
from policy.specs import ModelSpec, WorkloadSpec

IO_TASKS: tuple[str, ...] = (
    "load_weight",
    "load_cache",
    "load_activation",
    "store_cache",
    "store_activation",
)
"""The five load/store tasks that run beside compute; each needs at least one thread."""
MAX_COPY_THREADS = 16
"""Beyond this the copy pool only adds contention (disk queues are already full)."""
IMPROVEMENT = 1.01
"""A larger intra-op count must raise predicted throughput by 1% to be chosen."""


def attention_graph(compress_kv: bool) -> dict[str, tuple[str, ...]]:
    """Our CPU decode-attention compute task as op -> prerequisites (LM-Offload Fig. 6)."""
    graph: dict[str, tuple[str, ...]] = {
        "scale_q": (),
        "append_k": (),
        "append_v": (),
        "scores": ("scale_q", "append_k"),  # (b, heads, 1, kv_len)
        "softmax": ("scores",),
        "context": ("softmax", "append_v"),  # (b, heads, 1, head_dim)
    }
    if compress_kv:
        graph["dequant_k"] = ()
        graph["dequant_v"] = ()
        graph["scores"] = (*graph["scores"], "dequant_k")
        graph["context"] = (*graph["context"], "dequant_v")
    return graph


def max_concurrency(graph: dict[str, tuple[str, ...]]) -> int:
    """Widest level of Kahn's topological sort: the ops that can run at once."""
    indegree = {op: len(deps) for op, deps in graph.items()}
    users: dict[str, list[str]] = {op: [] for op in graph}
    for op, deps in graph.items():
        for dep in deps:
            users[dep].append(op)
    level = [op for op, degree in indegree.items() if degree == 0]
    widest, seen = 0, 0
    while level:
        widest, seen = max(widest, len(level)), seen + len(level)
        following = []
        for op in level:
            for user in users[op]:
                indegree[user] -= 1
                if indegree[user] == 0:
                    following.append(user)
        level = following
    assert seen == len(graph), "attention graph has a cycle"
    return widest


@dataclass(frozen=True)
class ThreadPlan:
    """Thread counts for the engine, with each load/store task's share."""

    num_cpu_threads: int
    """Intra-op threads of the compute task (torch.set_num_threads)."""
    num_interop_threads: int
    """Inter-op threads: the compute task's concurrency plus one per load/store task."""
    num_copy_threads: int
    io_threads: dict[str, int]


def io_volumes(model: ModelSpec, workload: WorkloadSpec, policy: Policy) -> dict[str, float]:
    """Bytes each load/store task moves per layer per decode step (tier crossings only)."""
    bls, dtype = policy.block_size, model.dtype_bytes
    packed = compressed_bytes_per_element(dtype) / dtype
    layer_bytes = model.total_weight_bytes / model.num_layers
    layer_bytes *= packed if policy.compress_weights else 1.0
    kv_tok = model.kv_bytes_per_token_per_layer * (packed if policy.compress_kv else 1.0)
    _, wc, wd = policy.weights_frac
    _, cc, cd = policy.kv_frac
    _, hc, hd = policy.act_frac
    # With CPU attention the CPU-homed cache never crosses PCIe; disk-homed still loads.
    moved_kv = cd if policy.cpu_attention else cc + cd
    act = (hc + hd) * bls * model.hidden_bytes_per_token
    return {
        "load_weight": (wc + wd) * layer_bytes,
        "load_cache": moved_kv * bls * (workload.prompt_len + workload.gen_len / 2) * kv_tok,
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


def max_compute_threads(hardware: HardwareSpec, compress_kv: bool) -> int:
    """The most intra-op threads Algorithm 3 can give compute on this machine; the search
    prices CPU attention at this count, and `choose_threads` then picks at or below it."""
    inter_op_compute = max_concurrency(attention_graph(compress_kv))
    max_threads = hardware.cpu_cores
    if hardware.compute_device == "cpu" or max_threads < inter_op_compute + len(IO_TASKS):
        return max_threads
    return (max_threads - len(IO_TASKS)) // inter_op_compute


def choose_threads(
    model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, policy: Policy
) -> ThreadPlan:
    """Algorithm 3: enumerate intra-op threads for compute, give the rest to load/store."""
    max_threads = hardware.cpu_cores
    volumes = io_volumes(model, workload, policy)
    uses_disk = policy.weights_frac[2] + policy.kv_frac[2] + policy.act_frac[2] > 0
    inter_op_compute = max_concurrency(attention_graph(policy.compress_kv))
    if hardware.compute_device == "cpu" or max_threads < inter_op_compute + len(IO_TASKS):
        # Too few cores to reserve one per load/store task (or the CPU does all the compute):
        # compute gets every core, copies share one or two threads that mostly wait on I/O.
        num_copy = 2 if uses_disk and max_threads > 2 else 1
        return ThreadPlan(max_threads, 1, num_copy, split_threads(num_copy, volumes))
    best: tuple[float, ThreadPlan] | None = None
    for intra_op in range(1, max_threads - len(IO_TASKS) + 1):
        free = max_threads - inter_op_compute * intra_op
        if free < len(IO_TASKS):
            continue
        io_threads = split_threads(free, volumes)
        candidate = dataclasses.replace(policy, num_cpu_threads=intra_op)
        throughput = estimate(candidate, model, workload, hardware).generation_throughput
        if best is None or throughput > best[0] * IMPROVEMENT:
            plan = ThreadPlan(
                num_cpu_threads=intra_op,
                num_interop_threads=inter_op_compute + len(IO_TASKS),
                num_copy_threads=min(MAX_COPY_THREADS, sum(io_threads.values())),
                io_threads=io_threads,
            )
            best = (throughput, plan)
    assert best is not None  # intra_op = 1 leaves >= 5 threads free (checked above)
    return best[1]


def plan_threads(
    model: ModelSpec, workload: WorkloadSpec, hardware: HardwareSpec, policy: Policy
) -> Policy:
    """`policy` with num_cpu_threads, num_interop_threads and num_copy_threads filled in."""
    plan = choose_threads(model, workload, hardware, policy)
    return dataclasses.replace(
        policy,
        num_cpu_threads=plan.num_cpu_threads,
        num_interop_threads=plan.num_interop_threads,
        num_copy_threads=plan.num_copy_threads,
    )
