"""The KV pool's share of the GPU budget: the planner's reserves (policy/reserves.py) are left
out, and nothing else."""

from __future__ import annotations

import dataclasses

from engine.executor.budgets import GPU_RESERVE_FRAC, kv_capacity_pages
from policy import Policy
from policy.affine import policy_vector
from policy.catalog import resolve_model_spec
from policy.reserves import STORE_WINDOW, gpu_reserves, reserve_bytes, step_workspace_bytes

GiB = 1 << 30


def test_a_step_of_kv_headed_for_the_host_is_reserved_on_the_gpu() -> None:
    """OPT-6.7B's shape, resident weights, 2,048-token steps: the new KV rows of
    STORE_WINDOW + 1 layers in flight to host memory (the layer loop waits for older copies)
    for the share of sequences homed there, none when all stay on the device; the KV pool
    gives up exactly the reserve, the host tiers nothing."""
    model = resolve_model_spec("opt-6.7b")
    kv_row = model.kv_bytes_per_token_per_layer
    on_device = Policy(gpu_batch_size=32)
    offloaded = dataclasses.replace(on_device, kv_frac=(0.0, 1.0, 0.0))
    prefill = {
        p: gpu_reserves(model, p, 512, 32, step_tokens=2048)["prefill"]
        for p in (on_device, offloaded)
    }

    gap = prefill[offloaded](policy_vector(offloaded)) - prefill[on_device](
        policy_vector(on_device)
    )
    assert gap == (STORE_WINDOW + 1) * 2048 * kv_row  # no past: a 512-token prompt fits a step
    budgets = {"gpu": 16 * GiB, "cpu": 96 * GiB, "disk": 64 * GiB}
    placed = {"gpu": int(12.4 * GiB), "cpu": 0, "disk": 0}
    page = 16 * 32 * kv_row  # 16 tokens x 32 layers
    reserve = reserve_bytes(gpu_reserves(model, offloaded, 512, 32, 2048), offloaded)
    without = kv_capacity_pages(budgets, placed, page)
    with_reserve = kv_capacity_pages(budgets, placed, page, gpu_reserve=reserve)
    assert without["gpu"] == int((16 * GiB * (1 - GPU_RESERVE_FRAC) - placed["gpu"]) // page)
    assert without["gpu"] - with_reserve["gpu"] in (reserve // page, reserve // page + 1)
    assert with_reserve["cpu"] == without["cpu"]  # host tiers are not charged


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


def _opt_125m():
    from engine.loading.generated import local_model_dir
    from engine.models.config import ModelConfig, read_hf_config

    model_dir = local_model_dir("dummy:opt-125m")
    return model_dir, ModelConfig.from_hf(read_hf_config(model_dir))


def test_a_steps_workspace_counts_the_logits() -> None:
    """A step's workspace: OPT-125M's 1,024 rows of 50,272 logits (float16, float32, the
    softmax) beside a 2,048-token step's layer (the H200's smoke case ran out of memory
    without them); two 4-bit layers decoded at once."""
    model = resolve_model_spec("opt-125m")
    workspace = step_workspace_bytes(model, tokens=2048, rows=1024)
    logits = 1024 * 50272 * (2 + 8)
    assert workspace - logits == 2048 * (2 * 768 + 3 * 3072) * 2  # the MLP's intermediates
    assert workspace > GPU_RESERVE_FRAC * 4 * GiB
    decoded = step_workspace_bytes(model, 16, 8, dequantized_layer=100)
    assert decoded - step_workspace_bytes(model, 16, 8) == 200


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
        spec = dataclasses.replace(resolve_model_spec(str(model_dir)), dtype_bytes=item)
        estimate = step_workspace_bytes(spec, ex.step_tokens, 256)
        logits = 256 * ex.config.vocab_size * (item + 8)
    assert abs(live) < 1 << 20  # the step's buffers all given back: none was the pool's
    assert estimate - logits < peak <= estimate, (peak, estimate)
