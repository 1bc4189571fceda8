"""Offloaded layers load into two fixed buffers in turn (engine/storage/weight_slots.py).

A layer's weights sit at the same addresses every step (what a CUDA graph reads), the
slotted layers alternate between the two buffers, and no load into a buffer is issued
before the layer that last used it has released it (its compute enqueued: on CUDA the copy
stream then waits for that event). Tokens equal transformers' with the slots on and off
(the placements of test_correctness run with them on)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.storage.weight_slots import WeightSlots
from policy import Policy

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]


def engine(model: Path, tmp_path: Path, **kwargs: Any) -> LLM:
    policy = kwargs.pop("policy", Policy(weights_frac=(0.0, 0.0, 1.0)))
    return LLM(str(model), policy=policy, device="cpu", offload_dir=tmp_path / "off", **kwargs)


def test_disk_layers_load_into_two_fixed_slots_in_turn(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    with engine(tiny_model("llama"), tmp_path) as llm:
        store = llm.executor.weights
        slots = store.slots
        assert slots is not None and len(slots.buffers) == 2
        decoders = [j for j in range(1, store.model.num_layers - 1)]
        assert sorted(slots.rank) == decoders  # every decoder layer, on disk here
        assert [slots.slot(j) for j in decoders] == [i % 2 for i in range(len(decoders))]
        owners = {slots.buffers[s].data_ptr(): s for s in range(2)}
        for _ in range(2):  # the same addresses on every load
            for j in decoders:
                loaded = store.load(j).value
                for name, tensor in loaded.items():
                    assert tensor.data_ptr() == slots.views[slots.slot(j)][name].data_ptr()
                assert min(t.data_ptr() for t in loaded.values()) in owners
        llm.generate(PROMPTS, GREEDY)


def test_slots_are_off_where_they_do_not_apply(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Compressed weights, MoE layers, a switch off, weights resident, and on the CPU the
    cpu tier (where the CPU computes: used where it lies)."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("llama", dict(policy=Policy(weights_frac=(0.0, 0.0, 1.0), compress_weights=True))),
        ("mixtral", dict(policy=Policy(weights_frac=(0.0, 0.0, 1.0)))),
        ("llama", dict(weight_slots=False)),
        ("llama", dict(policy=Policy())),
        ("llama", dict(policy=Policy(weights_frac=(0.0, 1.0, 0.0)))),
    ]
    for i, (kind, kwargs) in enumerate(cases):
        with engine(tiny_model(kind), tmp_path / str(i), **kwargs) as llm:
            assert llm.executor.weights.slots is None, (kind, kwargs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("batches", [1, 3])
def test_a_slot_is_loaded_only_after_its_last_user_released_it(
    tiny_model: Callable[[str], Path],
    references: Callable[[str], tuple[list[list[int]], list[list[int]]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overlap: bool,
    batches: int,
) -> None:
    """The host's order of events, over whole steps: each load into a slot comes after the
    release of the layer that used that slot before (on CUDA the copy then waits for the
    compute that release recorded), and tokens equal transformers'."""
    events: list[tuple[str, int]] = []
    target, release = WeightSlots.target, WeightSlots.release

    def spy_target(self: WeightSlots, j: int) -> Any:
        events.append(("load", j))
        return target(self, j)

    def spy_release(self: WeightSlots, j: int, done: Any) -> None:
        events.append(("release", j))
        release(self, j, done)

    monkeypatch.setattr(WeightSlots, "target", spy_target)
    monkeypatch.setattr(WeightSlots, "release", spy_release)
    prompts, expected = references("llama")
    policy = Policy(
        gpu_batch_size=2, num_gpu_batches=batches, weights_frac=(0.0, 0.0, 1.0), overlap=overlap
    )
    with engine(tiny_model("llama"), tmp_path, policy=policy) as llm:
        slots = llm.executor.weights.slots
        assert slots is not None
        params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert sum(kind == "load" for kind, _ in events) >= 2 * len(slots.rank)
    holder: dict[int, int | None] = {}  # slot -> layer in it, None once released
    for kind, j in events:
        s = slots.slot(j)
        if kind == "load":
            assert holder.get(s) is None, f"layer {j} loaded into slot {s} held by {holder[s]}"
            holder[s] = j
        else:
            assert holder.get(s) == j, f"layer {j} released slot {s} it did not hold"
            holder[s] = None
