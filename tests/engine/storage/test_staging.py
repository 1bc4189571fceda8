"""Staging buffers for host <-> device copies: made once per size class, reused only after the
copy that last touched them has completed, none made in a steady state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.storage.kv_store import KVRows, KVStore
from engine.storage.staging import MIN_BYTES, StagingPool, size_class
from policy import Policy
from tests.engine.tiny_models import MAX_TOKENS, random_prompts, vocab_size


class CopyEvent:
    """Stands in for a CUDA event on the CPU: `query` says whether the copy has completed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_buffers_come_back_and_go_out_again_by_size_class() -> None:
    pool = StagingPool(pinned=False)
    a = pool.take((100, 8), torch.float32)
    assert a.shape == (100, 8) and a.dtype == torch.float32 and pool.allocations == 1
    assert size_class(3200) == MIN_BYTES and size_class(MIN_BYTES + 1) == 2 * MIN_BYTES
    pool.give(a)
    b = pool.take((50,), torch.int64)  # the same size class: the same buffer
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1 and pool.lent == 1
    big = pool.take((MIN_BYTES,), torch.float16)  # twice the bytes: another class
    assert pool.allocations == 2
    pool.give(b)
    pool.give(big)
    assert pool.lent == 0


def test_a_buffer_is_not_reused_before_its_copy_completes() -> None:
    pool = StagingPool(pinned=False)
    a = pool.take((16,), torch.uint8)
    copy = CopyEvent()
    pool.give(a, copy)
    b = pool.take((16,), torch.uint8)
    assert b.data_ptr() != a.data_ptr() and pool.allocations == 2
    copy.done = True
    pool.give(b)
    c, d = pool.take((16,), torch.uint8), pool.take((16,), torch.uint8)
    assert {c.data_ptr(), d.data_ptr()} == {a.data_ptr(), b.data_ptr()}
    assert pool.allocations == 2


def test_a_steady_state_step_makes_no_buffer(tiny_model, tmp_path: Path) -> None:
    """Activations on disk load through staging buffers: the first steps make them, later
    ones reuse them, and none is left lent out after a step."""
    policy = Policy(act_frac=(0.0, 0.0, 1.0), kv_frac=(0.0, 0.0, 1.0))
    prompts = random_prompts(4, vocab_size("llama"), 2, 20, seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model("llama")), policy=policy, offload_dir=tmp_path, device="cpu") as llm:
        llm.generate(prompts, params)
        staging = llm.executor.device.staging
        made = staging.allocations
        assert made > 0 and staging.lent == 0
        llm.generate(prompts, params)
        assert staging.allocations == made and staging.lent == 0


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_host_kv_bound_for_the_device_is_read_into_staging(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_attention: bool
) -> None:
    """KV homed on the cpu tier is read for the compute device through staging buffers
    (pinned on a GPU, where an unpinned read makes the copy wait), and for CPU attention as
    it is: what the pipeline asks of KVStore.read, recorded."""
    asked: set[tuple[str, bool]] = set()
    read = KVStore.read

    def spy(self: KVStore, tier: str, layer: int, kv_rows: KVRows, staged: bool = False) -> Any:
        asked.add((tier, staged))
        return read(self, tier, layer, kv_rows, staged)

    monkeypatch.setattr(KVStore, "read", spy)
    policy = Policy(kv_frac=(0.0, 1.0, 0.0), cpu_attention=cpu_attention)
    prompts = random_prompts(3, vocab_size("llama"), 4, 12, seed=5)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model("llama")), policy=policy, offload_dir=tmp_path, device="cpu") as llm:
        llm.generate(prompts, params)
    assert asked == {("cpu", not cpu_attention)}
