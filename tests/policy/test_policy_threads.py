"""LM-Offload Algorithm 3: thread-level parallelism control."""

import dataclasses

from policy.catalog import BUILTIN_MODELS
from policy.hardware import FLEXGEN_T4
from policy.paper import FLEXGEN_TABLE15
from policy.specs import WorkloadSpec
from policy.threads import LOAD_TASKS, choose_threads, io_volumes, plan_threads, split_threads

OPT_30B = BUILTIN_MODELS["opt-30b"]
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
POLICY = FLEXGEN_TABLE15["opt-30b"]  # FlexGen's own OPT-30B policy


def test_split_threads_is_proportional_and_complete() -> None:
    shares = split_threads(12, {"a": 3.0, "b": 1.0, "c": 0.0})
    assert sum(shares.values()) == 12 and min(shares.values()) >= 1
    assert shares["a"] > shares["b"] >= shares["c"]


def test_algorithm_3_respects_the_core_budget() -> None:
    plan = choose_threads(OPT_30B, WORKLOAD, FLEXGEN_T4, POLICY)
    assert plan.num_cpu_threads + sum(plan.io_threads.values()) == 32
    assert all(n >= 1 for n in plan.io_threads.values())
    # the pools the engine makes are the tasks' shares, and the heaviest task gets the most
    assert plan.num_load_threads == sum(plan.io_threads[t] for t in LOAD_TASKS)
    assert plan.num_store_threads == sum(plan.io_threads.values()) - plan.num_load_threads
    volumes = io_volumes(OPT_30B, WORKLOAD, POLICY)
    heaviest = max(volumes, key=volumes.__getitem__)
    assert plan.io_threads[heaviest] == max(plan.io_threads.values()) > 1
    # CPU attention saturates at 8 threads on this profile: the knee, not all cores.
    assert 1 < plan.num_cpu_threads <= 8


def test_few_cores_fall_back_to_compute_everything() -> None:
    small = dataclasses.replace(FLEXGEN_T4, num_cpu_cores=2)
    policy = plan_threads(OPT_30B, WORKLOAD, small, POLICY)
    threads = (policy.num_cpu_threads, policy.num_load_threads, policy.num_store_threads)
    assert threads == (2, 1, 1)  # nothing on disk: one load thread, one store thread
