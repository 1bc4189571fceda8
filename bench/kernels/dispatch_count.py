"""What one decoder layer of a decode step dispatches on the CUDA code path, counted on the CPU.

    python -m bench.kernels.dispatch_count [--json bench/results/dispatch-count-cpu.json]

The demo model (a Llama of random weights), a decode step of 4 sequences whose KV is read in
place, on the path the CUDA engine runs (the CPU's native kernels off): with torch's own ops,
and with the fused Triton ops and the Triton decode attention (run by Triton's interpreter
here). Counted per layer: aten operators that launch a kernel, Triton kernel launches,
views (no kernel) and allocations (the caching allocator, no kernel). Each kernel is a
launch and a trip through the dispatcher: host time a decode step of a small batch pays
per layer before any GPU work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {
    "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.slice", "aten.select",
    "aten.as_strided", "aten.detach", "aten.expand", "aten.split", "aten.split_with_sizes",
    "aten.unsqueeze", "aten.squeeze", "aten.permute", "aten.alias", "aten.unbind", "aten.chunk",
    "aten._reshape_alias", "aten.unflatten",
}  # fmt: skip
"""Operators that only make a new view of a tensor's memory: no kernel on a GPU."""
ALLOCATIONS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty"}
"""Operators that only take memory from the caching allocator: no kernel either."""


class Dispatched(TorchDispatchMode):
    """Counts the operators dispatched on this thread, and the Triton launches it makes,
    leaving out what runs inside a launch (Triton's interpreter runs its own operators)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self._inside = threading.local()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not getattr(self._inside, "launch", False):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting(self) -> Iterator[None]:
        """This mode on, and the Triton launches of this thread counted, for the body."""
        from engine.kernels.triton_launch import Kernel

        launch, thread = Kernel.launch, threading.get_ident()

        def counted(kernel: Kernel, *args: Any, **kwargs: Any) -> None:
            if threading.get_ident() == thread:
                self.ops[f"triton.{kernel.fn.__name__}"] += 1
                self._inside.launch = True
            try:
                launch(kernel, *args, **kwargs)
            finally:
                self._inside.launch = False

        Kernel.launch = counted  # type: ignore[method-assign,assignment]
        try:
            with self:
                yield
        finally:
            Kernel.launch = launch  # type: ignore[method-assign]

    def kinds(self) -> dict[str, int]:
        """{kernels, views, allocations} over the counted operators."""
        views = sum(n for op, n in self.ops.items() if op in VIEWS)
        allocations = sum(n for op, n in self.ops.items() if op in ALLOCATIONS)
        return {
            "kernels": sum(self.ops.values()) - views - allocations,
            "views": views,
            "allocations": allocations,
        }


def decode_layer_ops(model_dir: Path, fused: bool) -> Dispatched:
    """The operators of one decoder layer of a decode step of 4 sequences."""
    from engine import LLM, SamplingParams
    from engine.kernels import PagedKernels, cuda_dense_ops, triton_attention
    from policy import Policy

    llm = LLM(
        str(model_dir),
        policy=Policy(gpu_batch_size=4),
        device="cpu",
        dtype="float32",
        native_kernels=False,
        prepack_weights=False,
    )
    pipeline = llm.executor.pipeline
    if fused:
        llm.executor.model.dense_ops = cuda_dense_ops()
        pipeline.kernels = PagedKernels(triton_attention.paged_decode, None)
    counts: list[Dispatched] = []
    compute = pipeline._compute

    def counted(j: int, w: Any, h: Any, past: Any, batch: Any) -> Any:
        group = batch.device_group
        decoding = group is not None and group.layout.q_max == 1 and batch.num_tokens == 4
        if llm.executor.model.layer_kind(j) != "decoder" or not decoding or counts:
            return compute(j, w, h, past, batch)
        mode = Dispatched()
        with mode.counting():
            out = compute(j, w, h, past, batch)
        counts.append(mode)
        return out

    pipeline._compute = counted  # type: ignore[method-assign]
    with llm:
        llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    if not counts:
        raise RuntimeError("no decode step ran")
    return counts[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # Triton's interpreter runs its own jit functions only if told before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from engine.loading.demo import demo_model_dir

    model = demo_model_dir()
    paths = (("torch", False), ("fused", True))
    runs = {name: decode_layer_ops(model, fused) for name, fused in paths}
    header = ["path", "kernels", "of them Triton", "views", "allocations"]
    rows = []
    for name, label in (("torch", "torch's own ops"), ("fused", "Triton ops and decode attention")):
        kinds = runs[name].kinds()
        triton = sum(n for op, n in runs[name].ops.items() if op.startswith("triton."))
        rows.append(
            [
                label,
                str(kinds["kernels"]),
                str(triton),
                str(kinds["views"]),
                str(kinds["allocations"]),
            ]
        )
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(row))
    if args.json:
        record = {
            "ops": {name: dict(run.ops) for name, run in runs.items()},
            "table": {"header": header, "rows": rows},
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
