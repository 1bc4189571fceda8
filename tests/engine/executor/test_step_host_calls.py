"""A resident step asks the host for nothing but its sampled tokens.

On a GPU, every host read of the device inside a step (`.item()`, `.tolist()`, a
synchronize) waits for all the kernels queued before it, and every
`torch.tensor(list, device=cuda)` is a copy from pageable memory that waits the same way:
the host then builds the next inputs while the device idles. So a resident step stages
its index inputs and sampling settings in one host buffer and copies them with one
non-blocking copy (`StepInputs`), and reads the device once, for the tokens. This test
counts, on the CPU, what every step of every resident placement asks, through the same
calls the CUDA path makes: prefill, decode and mixed steps; greedy and drawn rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.core.protocol import StepPlan
from engine.storage.device import Device
from policy import Policy
from tests.engine.executor.engine_frames import engine_caller

# The attention layouts (engine/executor/attention.py: RaggedLayout) still build their
# small per-sequence length tensors themselves: they become the paged attention kernel's
# metadata, staged with the rest, when that kernel lands (docs/architecture.md, CUDA).
ALLOWED_LISTS = ("engine/executor/attention.py",)
ALLOWED_READS: tuple[str, ...] = ()
# The staging's own write of a step's lists into its host buffer (a numpy view of it).
HOST_WRITES = ("numpy at engine/executor/step_inputs.py",)

RESIDENT: dict[str, dict[str, object]] = {
    "one-gpu-batch": dict(gpu_batch_size=2),
    "three-gpu-batches": dict(gpu_batch_size=1, num_gpu_batches=3),
}

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21, 22, 23]]
SETTINGS = [
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=3, temperature=1.0, min_p=0.1, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
]


class StepCounter(TorchDispatchMode):
    """Per step, the host reads of the device and the tensors made from Python lists that
    the engine asks for while `step` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.step: str | None = None
        self.calls: list[Counter[str]] = []

    def note(self, what: str) -> None:
        if self.step is not None:
            where = engine_caller()
            if where is not None:
                self.calls[-1][f"{what} at {where}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) == "aten._local_scalar_dense":  # .item(), int(t), bool(t)
            self.note("item")
        return func(*args, **(kwargs or {}))


def spying(counter: StepCounter, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        counter.note(name)
        return method(*args, **kwargs)

    return spy


def from_lists(counter: StepCounter, make: Callable[..., Any]) -> Callable[..., Any]:
    def spy(data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, list | tuple):
            counter.note(make.__name__ + "(list)")
        return make(data, *args, **kwargs)

    return spy


@contextmanager
def counting_steps(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[StepCounter, list[str], list[int]]]:
    """Count inside `Executor.execute`, per step: yields the counter, each step's kind and
    the host-to-device copies of its inputs."""
    counter = StepCounter()
    monkeypatch.setattr(Device, "synchronize", spying(counter, "synchronize", Device.synchronize))
    for name in ("tolist", "item", "cpu", "numpy"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, spying(counter, name, method))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, from_lists(counter, getattr(torch, name)))
    executor = llm.executor
    execute = executor.execute
    kinds: list[str] = []
    copies: list[int] = []

    def counted(plan: StepPlan) -> Any:
        if not plan.chunks:
            return execute(plan)
        lens = {len(c.token_ids) > 1 for c in plan.chunks}
        kinds.append("mixed" if len(lens) == 2 else "prefill" if True in lens else "decode")
        counter.calls.append(Counter())
        before = executor.inputs.num_copies
        counter.step = kinds[-1]
        try:
            with counter:
                return execute(plan)
        finally:
            counter.step = None
            copies.append(executor.inputs.num_copies - before)

    monkeypatch.setattr(executor, "execute", counted)
    yield counter, kinds, copies


@pytest.mark.parametrize(
    "placement",
    [pytest.param(n, marks=pytest.mark.slow) if n != "one-gpu-batch" else n for n in RESIDENT],
)
def test_a_resident_step_reads_the_device_once_and_copies_its_inputs_once(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    placement: str,
) -> None:
    policy = Policy(**RESIDENT[placement])  # type: ignore[arg-type]
    with LLM(str(tiny_model("llama")), policy=policy, device="cpu", offload_dir=tmp_path) as llm:
        llm.generate(PROMPTS, SETTINGS)  # warm-up: the KV pools and staging buffers grow
        with counting_steps(llm, monkeypatch) as (counter, kinds, copies):
            outputs = llm.generate(PROMPTS, SETTINGS)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in SETTINGS]
    assert {"prefill", "decode", "mixed"} <= set(kinds), kinds
    for kind, calls, copied in zip(kinds, counter.calls, copies, strict=True):
        reads = {
            call: n
            for call, n in calls.items()
            if not call.startswith(("tensor(list)", *HOST_WRITES, *ALLOWED_READS))
        }
        assert list(reads.values()) == [1], f"{kind} step read the device: {reads}"
        (read,) = reads
        assert read.startswith("tolist at engine/executor/sampler.py"), read
        lists = [
            call
            for call in calls
            if call.startswith("tensor(list)")
            and not call.split(" at ")[1].startswith(ALLOWED_LISTS)
        ]
        assert lists == [], f"{kind} step made tensors from lists: {lists}"
        assert copied == 1, f"{kind} step copied its inputs {copied} times"


def test_the_counter_sees_a_read_and_a_list_slipped_into_a_step(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe itself: an `.item()` and a tensor from a list inside the layer loop are
    counted (a counter that saw nothing would pass the test above on any code)."""
    with LLM(str(tiny_model("llama")), policy=Policy(), device="cpu", offload_dir=tmp_path) as llm:
        pipeline = llm.executor.pipeline
        compute = pipeline._compute

        def blocking_compute(*args: Any, **kwargs: Any) -> Any:
            out = compute(*args, **kwargs)
            out[0].abs().max().item()
            torch.tensor([1, 2, 3])
            return out

        monkeypatch.setattr(pipeline, "_compute", blocking_compute)
        with counting_steps(llm, monkeypatch) as (counter, _, _):
            llm.generate([[5, 6, 7]], SETTINGS[0])
    seen = {call.split(" at ")[0] for calls in counter.calls for call in calls}
    assert {"item", "tensor(list)", "tolist"} <= seen


def test_a_resident_steps_loads_and_stores_make_no_future(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resident step's loads and stores move no byte and run inline: each is a `Done`, not
    a `Future` (a lock, a condition and ~40 Python calls each, for every layer and GPU batch
    of every step, with nothing to wait for)."""
    made: Counter[str] = Counter()
    init = Future.__init__

    def counted(future: Future[Any]) -> None:
        made[engine_caller() or "outside the engine"] += 1
        init(future)

    policy = Policy(gpu_batch_size=1, num_gpu_batches=3)
    with LLM(str(tiny_model("llama")), policy=policy, device="cpu", offload_dir=tmp_path) as llm:
        assert llm.policy.overlap  # the looking-ahead loop, which hands moving loads to threads
        llm.generate(PROMPTS, SETTINGS)
        monkeypatch.setattr(Future, "__init__", counted)
        outputs = llm.generate(PROMPTS, SETTINGS)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in SETTINGS]
    assert not [where for where in made if where.startswith("engine/executor/")], made
