"""The layer loop never blocks the host on the device.

On a GPU a host-side wait inside the layer loop (a stream or device synchronize, an
event's host wait, `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a fresh pinned buffer)
stalls the enqueueing of every later kernel and copy: the zig-zag schedule then hides
nothing. Waiting belongs to the copy threads (which hand the loop an event) and to the
sampler after the last layer. On the CPU the same code runs through the Device's stream
and event interface, so this test records what the thread that runs the layers asks for
between the first layer and the sampler, for every placement with overlap on (weights, KV
and activations on each tier, 4-bit weights and KV, CPU attention, nano-batches, offloaded
experts and states): it fails on any of them. (With overlap off, the ablation, loads and
stores run inline in the loop and wait by design. On CUDA one bounded wait is by design too:
`CopyWindow` holds the loop to STORE_WINDOW copies of new KV rows to host memory ahead of
the device, so that a step's rows do not all wait on the device at once; by then the device
has that many layers queued. On the CPU copies carry no event and it never waits.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.storage.device import Device
from policy import Policy
from tests.engine.executor.engine_frames import engine_caller
from tests.engine.executor.test_correctness import PLACEMENTS

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

# The ways the host waits for the device: Device methods and tensor methods that copy a
# device value to the host before returning.
DEVICE_WAITS = ("synchronize", "host_wait", "host_empty")
TENSOR_WAITS = ("tolist", "cpu", "numpy")
SCALAR_OPS = ("aten._local_scalar_dense",)  # .item(), bool(t), int(t), float(t)

# The one wait the loop needs: an MoE layer reads how many rows each expert got, once per
# layer and block, to run (and, offloaded, fetch) only the experts picked. Data-dependent
# by nature; the offloading engines (MoE-Gen, KTransformers) read the routing too.
ALLOWED = ("Tensor.tolist at engine/models/moe.py",)


class Recorder(TorchDispatchMode):
    """Host waits asked for by the engine on one thread while `recording` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.recording = False
        self.calls: list[str] = []

    def note(self, what: str) -> None:
        if self.recording and threading.get_ident() == self.thread:
            where = engine_caller()
            if where is not None:
                self.calls.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in SCALAR_OPS:
            self.note(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def spying(recorder: Recorder, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        recorder.note(name)
        return method(*args, **kwargs)

    return spy


@contextmanager
def recording_layer_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """Record host waits on the thread that runs the pipeline, inside `pipeline.run` only
    (what comes before the first layer and the sampler after the last are not the loop)."""
    recorder = Recorder()
    for name in DEVICE_WAITS:
        monkeypatch.setattr(Device, name, spying(recorder, f"Device.{name}", getattr(Device, name)))
    for name in TENSOR_WAITS:
        monkeypatch.setattr(
            torch.Tensor, name, spying(recorder, f"Tensor.{name}", getattr(torch.Tensor, name))
        )
    pipeline = llm.executor.pipeline
    run = pipeline.run

    def recorded_run(*args: Any, **kwargs: Any) -> Any:
        recorder.thread, recorder.recording = threading.get_ident(), True
        try:
            with recorder:
                return run(*args, **kwargs)
        finally:
            recorder.recording = False

    monkeypatch.setattr(pipeline, "run", recorded_run)
    yield recorder


LOOPS: dict[str, tuple[str, dict[str, object]]] = {
    **{name: ("llama", dict(overlap=True, **p)) for name, p in PLACEMENTS.items()},
    "nano-batches": (
        "llama",
        dict(num_nano_batches=2, kv_frac=(0.5, 0.5, 0.0), cpu_attention=True),
    ),
    "nano-batches-weights-offloaded": (
        "llama",
        dict(num_nano_batches=2, weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 0.5, 0.5)),
    ),
    "activations-cpu": ("llama", dict(act_frac=(0.0, 1.0, 0.0), kv_frac=(0.5, 0.5, 0.0))),
    # 4-bit weights and KV decoded on the compute device, on every tier
    "compressed-weights-kv-cpu-attention": (
        "llama",
        dict(
            compress_weights=True,
            compress_kv=True,
            weights_frac=(0.3, 0.3, 0.4),
            kv_frac=(0.3, 0.4, 0.3),
            cpu_attention=True,
        ),
    ),
    "compressed-kv-on-host": (
        "llama",
        dict(compress_kv=True, kv_frac=(0.0, 0.5, 0.5), cpu_attention=False),
    ),
    # OPT's layer (biases, learned positions) offloaded the way the GPU pass runs it
    "opt-weights-kv-offloaded": (
        "opt",
        dict(weights_frac=(0.2, 0.8, 0.0), kv_frac=(0.0, 1.0, 0.0), cpu_attention=True),
    ),
    "moe-experts-offloaded": (
        "mixtral",
        dict(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 1.0, 0.0)),
    ),
    # a hybrid's states gathered from and written back to both tiers (StateStore)
    "hybrid-states-split": (
        "qwen3_next",
        dict(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.5, 0.5, 0.0)),
    ),
    "parallel-hybrid-mixed": (
        "falcon_h1",
        dict(weights_frac=(0.3, 0.3, 0.4), kv_frac=(0.4, 0.3, 0.3), cpu_attention=True),
    ),
}


@pytest.mark.parametrize(
    "placement",
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "parallel-hybrid-mixed" else name
        for name in LOOPS
    ],
)
def test_the_layer_loop_never_waits_on_the_host(
    tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    placement: str,
) -> None:
    kind, placed = LOOPS[placement]
    policy = Policy(**placed)  # type: ignore[arg-type]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    with (
        LLM(
            str(tiny_model(kind)), policy=policy, device="cpu", offload_dir=tmp_path / "offload"
        ) as llm,
        recording_layer_loop(llm, monkeypatch) as recorder,
    ):
        outputs = llm.generate(prompts, GREEDY)
        runs = [call for call in recorder.calls if not call.startswith(ALLOWED)]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    assert runs == [], f"the layer loop waited on the host: {sorted(set(runs))}"


def test_the_recorder_sees_a_wait_in_the_loop(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe itself: a `.item()` and a device synchronize slipped into a layer's compute
    are caught (a recorder that saw nothing would pass the test above on any code)."""
    with LLM(
        str(tiny_model("llama")), policy=Policy(), device="cpu", offload_dir=tmp_path / "offload"
    ) as llm:
        pipeline = llm.executor.pipeline
        compute = pipeline._compute

        def blocking_compute(*args: Any, **kwargs: Any) -> Any:
            out = compute(*args, **kwargs)
            pipeline.device.synchronize()
            out[0].abs().max().item()
            return out

        monkeypatch.setattr(pipeline, "_compute", blocking_compute)
        with recording_layer_loop(llm, monkeypatch) as recorder:
            llm.generate([[5, 6, 7]], GREEDY)
    kinds = {call.split(" at ")[0] for call in recorder.calls}
    assert kinds == {"Device.synchronize", "aten._local_scalar_dense"}
