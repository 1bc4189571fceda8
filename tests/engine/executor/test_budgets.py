"""The KV pool's share of the GPU budget: what a step's stores keep in flight is left out."""

from __future__ import annotations

from engine.executor.budgets import (
    GPU_RESERVE_FRAC,
    STORE_WINDOW,
    kv_capacity_pages,
    step_workspace_bytes,
    stores_in_flight,
)
from policy import Policy

GiB = 1 << 30


def test_a_step_of_kv_headed_for_the_host_is_reserved_on_the_gpu() -> None:
    """The H200's OPT-6.7B case under 16 GiB: 12.4 GiB of weights on the GPU, 94% of the KV
    cache in CPU memory, 2,048-token steps of 16 KiB KV rows: the rows of STORE_WINDOW + 1
    layers in flight (the layer loop waits for older copies), taken from the KV pool's share
    instead of from the margin activations need; a step's tokens split over its GPU batches;
    output rows bound for the host, every layer's."""
    offloaded_kv = Policy(gpu_batch_size=32, kv_frac=(0.06, 0.94, 0.0))
    in_flight = stores_in_flight(offloaded_kv, 2048, 32, 16 << 10, 8 << 10)
    assert in_flight == (STORE_WINDOW + 1) * 2048 * (16 << 10)
    two = Policy(gpu_batch_size=48, num_gpu_batches=2, kv_frac=(0.3, 0.7, 0.0))
    assert stores_in_flight(two, 49152, 32, 16 << 10, 8 << 10) == 4 * 24576 * (16 << 10)
    assert stores_in_flight(offloaded_kv, 2048, 2, 16 << 10, 0) == 2 * 2048 * (16 << 10)
    budgets = {"gpu": 16 * GiB, "cpu": 96 * GiB, "disk": 64 * GiB}
    placed = {"gpu": int(12.4 * GiB), "cpu": 0, "disk": 0}
    page = 16 * 32 * (16 << 10)  # 16 tokens x 32 layers x 16 KiB
    without = kv_capacity_pages(budgets, placed, page)
    with_stores = kv_capacity_pages(budgets, placed, page, in_flight)
    assert without["gpu"] == int((16 * GiB * (1 - GPU_RESERVE_FRAC) - placed["gpu"]) // page)
    assert without["gpu"] - with_stores["gpu"] == in_flight // page
    assert with_stores["cpu"] == without["cpu"]  # host tiers are not charged


def test_the_copy_window_waits_for_the_oldest_copy_beyond_its_depth() -> None:
    """`CopyWindow(3)`: the fourth copy admitted makes the host wait for the first, the
    fifth for the second; CPU copies (no event) are never waited for."""
    from engine.storage.device import CopyWindow

    class Copy:
        def __init__(self) -> None:
            self.waited = False

        def synchronize(self) -> None:
            self.waited = True

    window = CopyWindow(3)
    copies = [Copy() for _ in range(5)]
    for c in copies[:3]:
        window.admit(c)
    window.admit(None)
    assert not any(c.waited for c in copies) and window.waits == 0
    window.admit(copies[3])
    assert [c.waited for c in copies] == [True, False, False, False, False]
    window.admit(copies[4])
    assert [c.waited for c in copies] == [True, True, False, False, False] and window.waits == 2


def test_nothing_is_in_flight_when_kv_and_activations_stay_on_the_device() -> None:
    assert stores_in_flight(Policy(), 2048, 32, 16 << 10, 8 << 10) == 0
    acts_off = Policy(act_frac=(0.0, 1.0, 0.0))
    assert stores_in_flight(acts_off, 100, 4, 64, 32) == 100 * 4 * 32


def _opt_125m():
    from engine.loading.generated import local_model_dir
    from engine.models.config import ModelConfig, read_hf_config

    model_dir = local_model_dir("dummy:opt-125m")
    return model_dir, ModelConfig.from_hf(read_hf_config(model_dir))


def test_a_steps_workspace_is_kept_from_the_kv_pool() -> None:
    """The gpu tier's KV pages leave the larger of 10% of its budget and a step's workspace:
    OPT-125M's 1,024 rows of 50,272 logits (float16, float32, the softmax) are over 10% of
    4 GiB (the H200's smoke case ran out of memory there), a 2,048-token step's layer is not."""
    config = _opt_125m()[1]
    workspace = step_workspace_bytes(config, 2, tokens=2048, rows=1024)
    logits = 1024 * 50272 * (2 + 8)
    assert workspace - logits == 2048 * (2 * 768 + 3 * 3072) * 2  # the MLP's intermediates
    assert workspace > GPU_RESERVE_FRAC * 4 * GiB
    budgets = {"gpu": 4 * GiB, "cpu": 8 * GiB, "disk": 64 * GiB}
    placed = {"gpu": 250 << 20, "cpu": 0, "disk": 0}
    page = 16 * 12 * 3072
    flat = kv_capacity_pages(budgets, placed, page)
    kept = kv_capacity_pages(budgets, placed, page, workspace=workspace)
    assert kept["gpu"] == int((4 * GiB - placed["gpu"] - workspace) // page) < flat["gpu"]
    small = step_workspace_bytes(config, 2, tokens=2048, rows=8)
    assert kv_capacity_pages(budgets, placed, page, workspace=small) == flat  # 10% holds it
    # two 4-bit layers decoded at once
    assert (
        step_workspace_bytes(config, 2, 16, 8, dequantized_layer=100)
        - step_workspace_bytes(config, 2, 16, 8)
        == 200
    )


def test_the_workspace_bounds_what_a_step_allocates() -> None:
    """What the step's compute allocates beside the weights and the KV pool, measured by
    torch's profiler on the CPU (the pool grown beforehand, so only a step's own buffers
    come and go): 256 sequences of OPT-125M's shape, prefill then decode, under the
    estimate; without the logits' share the estimate is under it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    model_dir, _ = _opt_125m()
    policy = Policy(gpu_batch_size=256)
    with LLM(str(model_dir), policy=policy, device="cpu", gpu_mem=1 * GiB) as llm:
        ex = llm.executor
        ex.kv.reserve("gpu", ex.kv.capacity["gpu"] or 0)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 50000, (16,), generator=g).tolist() for _ in range(256)]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            llm.generate(prompts, params)
        events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        live = peak = 0
        for _, nbytes in changes:
            live += nbytes
            peak = max(peak, live)
        item = ex.dtype.itemsize
        estimate = step_workspace_bytes(ex.config, item, ex.step_tokens, 256)
        logits = 256 * ex.config.vocab_size * (item + 8)
    assert abs(live) < 1 << 20  # the step's buffers all given back: none was the pool's
    assert estimate - logits < peak <= estimate, (peak, estimate)
