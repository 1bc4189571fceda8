"""Tensor methods whose Python bindings take a CUDA device guard, which a CPU build of torch
refuses even for fake tensors: the same operations through the dispatcher, for the rehearsal
of the CUDA path (engine/fake_cuda.py). Host tensors keep torch's own methods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)

_aten = torch.ops.aten
ORIGINAL_COPY = torch.Tensor.copy_
ORIGINAL_TO = torch.Tensor.to
ORIGINAL_CONTIGUOUS = torch.Tensor.contiguous


def copy(t: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`Tensor.copy_`."""
    if "cuda" not in (t.device.type, getattr(src, "device", t.device).type):
        return ORIGINAL_COPY(t, src, non_blocking)
    out: torch.Tensor = _aten.copy_.default(t, src, non_blocking)
    return out


def contiguous(
    t: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """`Tensor.contiguous`."""
    if t.device.type != "cuda" or t.is_contiguous(memory_format=memory_format):
        return ORIGINAL_CONTIGUOUS(t, memory_format=memory_format)
    out: torch.Tensor = _aten.clone.default(t, memory_format=memory_format)
    return out


def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`Tensor.to`: a tensor already of the device and dtype asked for comes back as it is."""
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    if isinstance(args[0] if args else None, torch.Tensor):
        device, dtype = args[0].device, args[0].dtype
    device = t.device if device is None else torch.device(device)
    if "cuda" not in (t.device.type, device.type):
        return ORIGINAL_TO(t, *args, **kwargs)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    dtype = dtype or t.dtype
    if device == t.device and dtype == t.dtype and not kwargs.get("copy"):
        return t
    out: torch.Tensor = _aten._to_copy.default(
        t, dtype=dtype, device=device, non_blocking=non_blocking
    )
    return out


def from_data(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`torch.tensor` / `torch.as_tensor` for CUDA: made on the host, then moved."""

    def made(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is None or torch.device(device).type != "cuda":
            return make(data, *args, device=device, **kwargs)
        return to(make(data, *args, **kwargs), "cuda")

    return made


def indexing(
    get: Callable[[torch.Tensor, Any], torch.Tensor], twins: Any
) -> tuple[Callable[[torch.Tensor, Any], torch.Tensor], Callable[[torch.Tensor, Any, Any], None]]:
    """`Tensor.__getitem__` and `__setitem__` for fake CUDA tensors (the Python binding takes a
    CUDA device guard, which a CPU build of torch refuses): a view comes back as the same
    view of the CUDA tensor (no new bytes, found on a meta twin of the same strides); a
    gather as a new tensor, its shape (a boolean mask's too) and values from the real twins
    where there are."""

    def twin(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if isinstance(t, tuple):
            return tuple(twin(i) for i in t)
        if isinstance(t, list):
            return [twin(i) for i in t]
        return t

    def real(t: Any) -> Any:
        if isinstance(t, FakeTensor):
            return twins[t]
        if isinstance(t, tuple):
            return tuple(real(i) for i in t)
        if isinstance(t, list):
            return [real(i) for i in t]
        return t

    def gathered(t: torch.Tensor, index: Any) -> torch.Tensor:
        try:
            with unset_fake_temporarily():
                values = get(real(t), real(index))
        except (KeyError, IndexError, RuntimeError):
            values = None
        if values is None:
            out = get(twin(t), twin(index))  # a mask without values fails here
            return torch.empty(out.shape, dtype=out.dtype, device=t.device)
        out = torch.empty(values.shape, dtype=values.dtype, device=t.device)
        twins[out] = values
        return out

    def getitem(t: torch.Tensor, index: Any) -> torch.Tensor:
        if t.device.type != "cuda":
            return get(t, index)
        shadow = twin(t)
        try:
            out = get(shadow, twin(index))
        except DynamicOutputShapeException:
            return gathered(t, index)
        if out.untyped_storage()._cdata == shadow.untyped_storage()._cdata:
            offset = t.storage_offset() + out.storage_offset()
            return torch.as_strided(t, out.shape, out.stride(), offset)
        return gathered(t, index)

    def setitem(t: torch.Tensor, index: Any, value: Any) -> None:
        target = getitem(t, index)
        if target.untyped_storage()._cdata != t.untyped_storage()._cdata:
            return  # an indexed store (`index_put_`): no bytes are made
        if isinstance(value, torch.Tensor):
            target.copy_(value)
        else:
            target.fill_(value)

    return getitem, setitem


def fused_attention(sdpa: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`scaled_dot_product_attention` as CUDA runs it for half types: a fused kernel (flash
    or memory-efficient, masks included) that allocates its output alone; the fake's
    decomposition would allocate the (B, nh, Q, L) scores, which no GPU run does."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        if q.device.type != "cuda":
            return sdpa(q, k, v, *args, **kwargs)
        return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)

    return attend


def methods() -> dict[str, Any]:
    """Tensor attribute -> its replacement."""
    return {
        "copy_": copy,
        "contiguous": contiguous,
        "to": to,
        "cuda": lambda t, *a, **k: to(t, "cuda"),
        "__invert__": lambda t: torch.bitwise_not(t),
        "__int__": lambda t: int(t.item()),
        "__float__": lambda t: float(t.item()),
    }
