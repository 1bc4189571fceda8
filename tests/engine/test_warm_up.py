"""No CUDA graph is captured and no Triton kernel compiled after the engine's warm-up.

Checked on the rehearsal's fake CUDA device (engine/fake_cuda.py): the engine's CUDA path
runs on tensors that hold no data, graph capture runs its bodies, and each Triton launch
counts the specialization a GPU would compile for its arguments (Triton's own binder,
`Kernel.note`). After `LLM(...)` returns (warmed up), a workload of prefill, decode and
mixed steps at many batch sizes and context lengths, long enough for split decodes, must
capture and compile nothing more; without the warm-up it does both.

A fake-CUDA run leaves the process as it found it (engine/fake_cuda.py `_left_as_found`,
tests/engine/test_rehearsal.py), so these may run before or beside the engine's CPU tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

from engine import LLM, SamplingParams
from engine.core.scheduler_config import pick_size
from engine.executor.cuda_graphs import GraphRunner
from engine.executor.warm_up import decode_rows
from engine.fake_cuda import fake_cuda
from engine.kernels.triton_launch import KERNELS, compiled_count
from engine.loading.generated import local_model_dir
from engine.storage.device_ledger import DeviceLedger
from policy import Policy

GiB = 1 << 30
# ragged prompts (one past a decode key tile, for split decodes) and lengths: sequences
# finish at different steps, so decodes run at many batch sizes and refills make mixed steps
PROMPTS = [[5 + i] * n for i, n in enumerate([3, 70, 4, 2, 9])]
MAX_TOKENS = [1, 3, 2, 4, 2]


@contextmanager
def rehearsed() -> Iterator[None]:
    with warnings.catch_warnings(), fake_cuda(DeviceLedger(), device_bytes=GiB, host_bytes=GiB):
        warnings.simplefilter("ignore")  # fake tensors' data pointers, read by the binder
        yield


def counts(llm: LLM) -> tuple[int, int]:
    graphs = llm.executor.pipeline.graphs
    assert graphs is not None
    return graphs.num_captures, compiled_count()


@pytest.mark.parametrize(
    "warm", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["warmed", "cold"]
)
def test_no_capture_and_no_compile_after_warm_up(
    tiny_model: Callable[[str], Path], warm: bool
) -> None:
    """Warmed: the workload captures and compiles nothing. Cold (the check itself): it
    captures graphs and meets new specializations, in a fresh process's state."""
    for kernel in KERNELS:  # as in a fresh process: no specialization met yet
        kernel.specializations.clear()
    model = local_model_dir(f"dummy:{tiny_model('llama')}")  # weights generated: no data read
    policy = Policy(gpu_batch_size=4)
    with rehearsed(), LLM(str(model), policy=policy, device="cuda", warmup=warm) as llm:
        info = llm.executor.describe().warm_up
        before = counts(llm)
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS
        ]
        kinds: set[str] = set()
        execute = llm.executor.execute

        def seen(plan):  # type: ignore[no-untyped-def]
            lens = {len(c.token_ids) > 1 for c in plan.chunks}
            kinds.add("mixed" if len(lens) == 2 else "prefill" if True in lens else "decode")
            return execute(plan)

        llm.executor.execute = seen  # type: ignore[method-assign]
        llm.generate(PROMPTS, params)
        after = counts(llm)
    assert kinds == {"prefill", "decode", "mixed"}
    if warm:
        assert info is not None and info.graphs_captured > 0 and info.kernels_compiled > 0
        assert info.num_steps >= 4 and info.seconds >= 0
        assert after == before, f"(captures, compiles) grew from {before} to {after}"
    else:
        assert info is None
        assert after[0] > before[0] and after[1] > before[1]  # the check can fail


def test_decode_rows_follow_the_scheduler_padding() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert decode_rows(sizes, 8, 1) == {0: [1, 2, 4, 8]}
    assert decode_rows(sizes, 5, 1) == {0: [1, 2, 4, 8]}  # 5 decodes run padded to 8
    assert decode_rows(None, 3, 1) == {0: [1, 2, 3]}
    rows = decode_rows(sizes, 2, 2)
    assert rows[0] == [1, 2]  # a batch before the step's last: its decodes
    # the last batch: its decodes plus the padding to the step's size
    expected = {s + pick_size(sizes, s + e) - (s + e) for s in (1, 2) for e in (0, 1, 2)}
    assert rows[1] == sorted(expected)


def test_the_warm_ups_graphs_share_one_pool_the_most_rows_first(
    tiny_model: Callable[[str], Path],
) -> None:
    """Every decode graph of every row count goes into one pool, captured the most rows first
    (each later capture fits in the blocks the first freed): the pool after the warm-up is
    what the largest capture alone needs, not a pool per row count (OPT-6.7B's rehearsal
    counted 1.86 GB of graph pools for 48 row counts, 3.8 MiB as one)."""
    model = local_model_dir(f"dummy:{tiny_model('llama')}")
    ledger = DeviceLedger()
    captured: list[tuple[int, int]] = []
    capture = GraphRunner.capture

    def noted(runner: GraphRunner, batch_index: int, rows: int) -> None:
        captured.append((batch_index, rows))
        capture(runner, batch_index, rows)

    with (
        warnings.catch_warnings(),
        fake_cuda(ledger, device_bytes=GiB, host_bytes=GiB),
        mock.patch.object(GraphRunner, "capture", noted),
    ):
        warnings.simplefilter("ignore")
        with LLM(str(model), policy=Policy(gpu_batch_size=4), device="cuda") as llm:
            pooled, order = ledger.held["graph pool"], list(captured)
            runner = llm.executor.pipeline.graphs
            assert runner is not None
            alone = GraphRunner(runner.model, runner.weights, runner.device, runner.dtype)
            alone.capture(0, max(rows for _, rows in order))
            largest = ledger.held["graph pool"] - pooled
    assert len(order) >= 4, order
    assert [rows for _, rows in order] == sorted((rows for _, rows in order), reverse=True)
    assert pooled == largest > 0, (pooled, largest)
