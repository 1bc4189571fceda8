"""The KV pool's share of the GPU budget: what a step's stores keep in flight is left out."""

from __future__ import annotations

from engine.executor.budgets import GPU_RESERVE_FRAC, kv_capacity_pages, stores_in_flight
from policy import Policy

GiB = 1 << 30


def test_a_step_of_kv_headed_for_the_host_is_reserved_on_the_gpu() -> None:
    """The H200's OPT-6.7B case under 16 GiB: 12.4 GiB of weights on the GPU, 94% of the KV
    cache in CPU memory, 2,048-token steps over 32 layers of 16 KiB KV rows: 1 GiB of rows in
    flight, taken from the KV pool's share instead of from the margin activations need."""
    offloaded_kv = Policy(gpu_batch_size=32, kv_frac=(0.06, 0.94, 0.0))
    in_flight = stores_in_flight(offloaded_kv, 2048, 32, 16 << 10, 8 << 10)
    assert in_flight == 1 * GiB
    budgets = {"gpu": 16 * GiB, "cpu": 96 * GiB, "disk": 64 * GiB}
    placed = {"gpu": int(12.4 * GiB), "cpu": 0, "disk": 0}
    page = 16 * 32 * (16 << 10)  # 16 tokens x 32 layers x 16 KiB
    without = kv_capacity_pages(budgets, placed, page)
    with_stores = kv_capacity_pages(budgets, placed, page, in_flight)
    assert without["gpu"] == int((16 * GiB * (1 - GPU_RESERVE_FRAC) - placed["gpu"]) // page)
    assert without["gpu"] - with_stores["gpu"] == in_flight // page
    assert with_stores["cpu"] == without["cpu"]  # host tiers are not charged


def test_nothing_is_in_flight_when_kv_and_activations_stay_on_the_device() -> None:
    assert stores_in_flight(Policy(), 2048, 32, 16 << 10, 8 << 10) == 0
    acts_off = Policy(act_frac=(0.0, 1.0, 0.0))
    assert stores_in_flight(acts_off, 100, 4, 64, 32) == 100 * 4 * 32
