"""What a CUDA graph captures must not touch host memory: checked on the CPU, on meta tensors.

`GraphRunner` captures each family's embedding and the dense ops before and after attention.
A host tensor copied to the device inside a capture ("Cannot copy between CPU and CUDA tensors
during CUDA graph capture": Gemma's embedding scale on the first H200 run), a device value read
back to the host (`.item()`, `.tolist()`, `.cpu()`: a synchronization, refused during capture)
or a host tensor read by a device kernel fails there. Here the same bodies run with every
weight and buffer on the meta device under a dispatch mode that refuses host tensors beside
meta ones (meta tensors also refuse `.item()`), so a family that would fail its capture fails
on the CPU first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine import LLM, SamplingParams
from engine.executor.cuda_graphs import GraphRunner
from engine.storage.quant import QuantizedTensor
from policy import Policy
from tests.engine.tiny_models import NEW_FAMILIES

META = torch.device("meta")


class HostTensorsRefused(TorchDispatchMode):
    """Fails any operator that takes a host tensor beside meta ones (a 0-dim host tensor only
    as an operand, which CUDA kernels read as a number; never copied to the device)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        on_meta = any(t.device == META for t in inputs + outputs)
        copy = func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_)
        host = [t for t in inputs if t.device.type == "cpu" and (t.dim() > 0 or copy)]
        if on_meta and host:
            raise AssertionError(f"{func} reads host tensors {[tuple(t.shape) for t in host]}")
        return out


class Uncaptured(GraphRunner):
    """The runner's bodies run once under `HostTensorsRefused` instead of being captured."""

    def _graph(self, body: Any) -> Any:
        with HostTensorsRefused():
            body()
        return None


def _to_meta(value: Any) -> Any:
    if isinstance(value, QuantizedTensor):
        return value.to(META)
    return value.to(META) if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("kind", ["llama", "opt", *NEW_FAMILIES])
def test_captured_bodies_read_no_host_tensors(tiny_model, kind: str) -> None:
    with LLM(
        str(tiny_model(kind)),
        policy=Policy(),
        device="cpu",
        dtype="float32",
        prepack_weights=False,
        native_kernels=False,  # the torch operators, as on CUDA
    ) as llm:
        model = llm.executor.model
        weights = [
            {k: _to_meta(v) for k, v in layer.values.items()}
            for layer in llm.executor.weights.layers
        ]
    assert model.can_capture
    runner = Uncaptured(model, weights, META, torch.float32)
    graphs = runner._capture((0,), rows=3)
    assert len(graphs.before) == len(graphs.after) == model.num_layers - 2


def test_the_check_refuses_a_host_copy() -> None:
    """The check itself: a host tensor copied to the device inside a body fails it."""
    with pytest.raises(AssertionError, match="host tensors"), HostTensorsRefused():
        torch.ones(3, device=META) * torch.tensor(2.0).to(META)


class ExternalReads(TorchDispatchMode):
    """The (operator, address) of every tensor an operator reads that this run did not make
    itself: what a CUDA graph would read by address at replay (its own intermediates live in
    its private pool and do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, int]] = []
        self._made: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in self._made:
                self.reads.append((str(func.overloadpacket), t.data_ptr()))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                self._made.add(t.data_ptr())
        return out


class AddressCheckedGraph:
    """A CUDA graph's contract, on the CPU: captured once, each replay runs the same body,
    which must read exactly the addresses it read at capture (a graph replays its kernels on
    the addresses it recorded: a weight or buffer that moved would be read stale)."""

    def __init__(self, body: Any) -> None:
        self.body = body
        with ExternalReads() as captured:
            body()
        self.reads = captured.reads
        self.replays = 0

    def replay(self) -> None:
        with ExternalReads() as now:
            self.body()
        assert now.reads == self.reads, "a replay read other addresses than its capture"
        self.replays += 1


class CheckedRunner(GraphRunner):
    def _graph(self, body: Any) -> Any:
        return AddressCheckedGraph(body)


@pytest.mark.parametrize(
    "placement",
    [
        dict(),  # resident
        dict(weights_frac=(0.0, 0.0, 1.0)),  # every layer offloaded: slots, embedding eager
        dict(weights_frac=(0.3, 0.0, 0.7), kv_frac=(0.0, 1.0, 0.0), cpu_attention=True),
        dict(gpu_batch_size=2, num_gpu_batches=3, weights_frac=(0.0, 0.0, 1.0)),
        dict(num_nano_batches=2, kv_frac=(0.5, 0.5, 0.0), cpu_attention=True),
        dict(num_nano_batches=2, weights_frac=(0.0, 0.0, 1.0)),
    ],
    ids=[
        "resident",
        "offloaded",
        "mixed-cpu-attention",
        "three-gpu-batches",
        "nano-batches",
        "nano-batches-offloaded",
    ],
)
def test_graph_replays_read_their_captured_addresses_and_match_transformers(
    tiny_model, references, tmp_path, placement: dict[str, Any]
) -> None:
    """The decode steps run through the graph runner's captured bodies, replayed under the
    contract above, with offloaded layers read from their slots and nano-batches through
    their own graphs: tokens equal transformers' and every replay read the addresses its
    capture did."""
    prompts, expected = references("llama")
    with LLM(
        str(tiny_model("llama")),
        policy=Policy(**placement),
        device="cpu",
        dtype="float32",
        offload_dir=tmp_path / "off",
        prepack_weights=False,
        native_kernels=False,  # the torch operators, as on CUDA
    ) as llm:
        executor = llm.executor
        weights = executor.weights.fixed_weights()
        assert weights is not None
        runner = CheckedRunner(executor.model, weights, torch.device("cpu"), torch.float32)
        one_batch = llm.policy.num_gpu_batches == 1
        if one_batch:  # mixed and prefill steps at the discrete sizes too, as the warm-up sets
            runner.dense_sizes = frozenset(llm.args.discrete_batch_sizes(llm.policy))
        executor.pipeline.graphs = runner
        params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert runner.num_replays > 0
    nano = placement.get("num_nano_batches", 1) > 1
    assert (runner.num_piecewise_replays > 0) == (one_batch and not nano)
    assert {len(key) for key in runner._graphs} == {3 if nano else 2}  # (batch, [nano,] rows)
    replayed = [g for graphs in runner._graphs.values() for g in (*graphs.before, *graphs.after)]
    assert replayed and all(g.replays > 0 for g in replayed)


def test_the_replay_contract_refuses_a_moved_tensor() -> None:
    """The check itself: a body that reads a tensor found anew at each call (as a fresh
    load would give) fails its replay; intermediates made inside the body do not count."""
    box = [torch.ones(4)]
    graph = AddressCheckedGraph(lambda: (box[0] * 2).exp() + 1)
    graph.replay()
    box[0] = torch.ones(4)
    with pytest.raises(AssertionError, match="other addresses"):
        graph.replay()
