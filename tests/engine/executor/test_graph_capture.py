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

from engine import LLM
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
    graphs = runner._capture(rows=3)
    assert len(graphs.before) == len(graphs.after) == model.num_layers - 2


def test_the_check_refuses_a_host_copy() -> None:
    """The check itself: a host tensor copied to the device inside a body fails it."""
    with pytest.raises(AssertionError, match="host tensors"), HostTensorsRefused():
        torch.ones(3, device=META) * torch.tensor(2.0).to(META)
