"""`fake_cuda`: the engine's CUDA code path, run where there is no GPU, on tensors that hold no
data, with every byte the device would hold counted (`DeviceLedger`).

Inside `with fake_cuda(ledger, ...)`, torch reports one CUDA device: tensors are torch's fake
tensors (`FakeTensorMode`: shapes, dtypes and devices, no storage), streams and events are
stand-ins that keep the ledger's clock (engine/storage/device_ledger.py), graph capture runs
its body once and keeps what it held as the graph's pool, Triton launches run nothing (their
outputs are allocated by the callers, as on a GPU) but count the specializations a GPU would
compile (`Kernel.note`), and host memory is the GPU machine's
(`host_bytes`). `Device`, the weight and KV stores, the block pipeline and the sampler run
unchanged, `is_cuda` true: the branches a GPU takes are the ones rehearsed. A value read back
to the host (`.item()`, `.tolist()`) is zero. The engine's pools run their tasks in the
submitting thread (fake tensors are not safe across threads): loads at once, as a copy thread
never behind, stores only when waited for, as one that is always behind (`LazyFuture`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from engine.storage.device_ledger import DeviceLedger, storage_key
from engine.storage.disk import DiskFile
from engine.storage.disk_kv import DiskKVPool

_aten = torch.ops.aten


class Counting(TorchDispatchMode):
    """Above the fake mode: counts device tensors into the ledger, turns host<->device
    copies into allocations (a CPU build of torch has no CUDA copy kernel, even for fakes),
    and keeps values where the engine reads them. A small tensor (up to SMALL_BYTES) computed
    from values has a real twin on the host, computed alongside (page tables, positions,
    lengths, sampled tokens of a tiny vocabulary...): the host reads the twin's values, and an
    operator whose output shape depends on values (`repeat_interleave`) gets its shape from
    the twin; a value without a twin reads as zero. Small host tensors made from real ones
    are real themselves."""

    def __init__(self, ledger: DeviceLedger) -> None:
        super().__init__()
        self.ledger = ledger
        self._lock = threading.RLock()
        self.twins: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with self._lock:  # the fake mode keeps per-call state on itself: one thread at a time
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        packet = func.overloadpacket
        if packet is _aten._local_scalar_dense:  # a read of a value: the host waits
            t = args[0]
            if t.device.type == "cuda":
                self.ledger.complete()
            twin = self.twins.get(t)
            if twin is not None:
                with unset_fake_temporarily():
                    return twin.item()
            return False if t.dtype == torch.bool else 0.0 if t.dtype.is_floating_point else 0
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
        if packet is _aten.copy_ and args[0].device != args[1].device:
            self._twin(func, args, kwargs, args[0])
            return args[0]
        if packet is _aten._to_copy and kwargs.get("device") is not None:
            src, device = args[0], torch.device(kwargs["device"])
            if device.type == src.device.type:  # a device guard there too: keep the device
                kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            else:
                if src.device.type == "cuda" and not kwargs.get("non_blocking"):
                    self.ledger.complete()  # a blocking copy to the host waits for the device
                if device.type == "cpu" and self.twins.get(src) is not None:
                    return self._real(func, args, kwargs)  # the host gets the values
                dtype = kwargs.get("dtype") or src.dtype
                out = torch.empty(src.shape, dtype=dtype, device=device)
                self._track(out)
                self._twin(func, args, kwargs, out)
                return out
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            real = self._real(func, args, kwargs) if self._has_twins(inputs) else None
            if real is None and packet is _aten.bincount:
                minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                real = _balanced_counts(args[0], minlength)
            if real is None:
                raise
            out = tree_map(_fake_like, real)
            if packet is _aten.bincount:
                self.twins[out] = real
        self._track(out)
        if not inputs and _small_on_host(out):
            with unset_fake_temporarily():  # made of real values: indices, lengths, tables
                return func(*args, **_host_kwargs(kwargs))
        self._twin(func, args, kwargs, out)
        return out

    def _has_twins(self, inputs: Sequence[torch.Tensor]) -> bool:
        return all(self.twins.get(t) is not None for t in inputs)

    def _real(self, func: Any, args: Any, kwargs: Any) -> Any:
        """`func` on the twins and real values (None where that fails)."""
        twins = self.twins

        def real(x: Any) -> Any:
            if isinstance(x, FakeTensor):
                return twins[x]
            if isinstance(x, torch.device) and x.type == "cuda":
                return torch.device("cpu")
            return x

        try:
            with unset_fake_temporarily():
                return func(*tree_map(real, args), **_host_kwargs(tree_map(real, kwargs)))
        except Exception:
            return None

    def _twin(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Give `out`'s small fake tensors twins, when every fake input has one."""
        outs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
        if not outs or not all(_small(t) for t in outs) or not self._has_twins(inputs):
            return
        real = self._real(func, args, kwargs)
        if real is None:
            return
        reals = [r for r in tree_leaves(real) if isinstance(r, torch.Tensor)]
        if isinstance(real, torch.Tensor) and len(outs) == 1:
            reals = [real]
        for o, r in zip(outs, reals, strict=False):
            if tuple(o.shape) == tuple(r.shape):
                self.twins[o] = r

    def _track(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                self.ledger.track(t)


def _host_kwargs(kwargs: Any) -> Any:
    """Keyword arguments of an operator rerun on the host (no pinned memory without CUDA)."""
    if not isinstance(kwargs, dict):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k != "pin_memory"}
    device = out.get("device")
    if device is not None and torch.device(device).type == "cuda":
        out["device"] = torch.device("cpu")
    return out


def _balanced_counts(values: torch.Tensor, minlength: int) -> torch.Tensor:
    """`bincount` of values the host cannot read (a MoE router's picks, made from hidden
    states that hold no data): `values.numel()` spread evenly over `minlength` bins, as a
    balanced router spreads its tokens over the experts (every expert runs, as the planner
    prices it: policy/moe.py). Read as zeros, every pick went to expert 0 alone."""
    bins = max(minlength, 1)
    with unset_fake_temporarily():
        counts = torch.full((bins,), values.numel() // bins, dtype=torch.int64)
        counts[: values.numel() % bins] += 1
    return counts


def _fake_like(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")


def _small(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() <= SMALL_BYTES


SMALL_BYTES = 1 << 20
"""Tensors up to this size keep their values (real host tensors, or fake device tensors
with a real twin); larger ones (homed weights, pools, staging) hold none, so that 30B
parameters cost nothing here."""


def _small_on_host(out: Any) -> bool:
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(
        t.device.type == "cpu" and t.numel() * t.element_size() <= SMALL_BYTES for t in tensors
    )


class FakeEvent:
    """A CUDA event: recorded at the ledger's clock, complete once the host waited for it."""

    ledger: DeviceLedger

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.clock = 0

    def record(self, stream: Any = None) -> None:
        self.clock = self.ledger.now()

    def synchronize(self) -> None:
        self.ledger.complete(self.clock)

    def query(self) -> bool:
        return self.ledger.done(self.clock)

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """A CUDA stream: waits are ordering only; synchronizing completes everything."""

    ledger: DeviceLedger
    _ids = 0

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        FakeStream._ids += 1
        self.stream_id = FakeStream._ids
        self.device = torch.device("cuda", 0)

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        self.ledger.complete()

    def query(self) -> bool:
        return True

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event


class FakeGraph:
    def replay(self) -> None:
        pass

    def reset(self) -> None:
        pass


def _skipping_fakes(method: Callable[..., None]) -> Any:
    """A disk read, write or checksum that does nothing for a fake tensor (KV pages spilled
    to the disk tier hold no data here; their host staging is counted where it is made)."""

    def run(self: Any, *args: Any) -> None:
        if not any(isinstance(a, FakeTensor) for a in args):
            method(self, *args)

    return run


class FakePool:
    """A graph memory pool (`graph_pool_handle`): the blocks its captures freed, which a
    later capture into it reuses before asking for more."""

    def __init__(self) -> None:
        self.nbytes = 0


@contextmanager
def _capture(ledger: DeviceLedger, pool: FakePool | None) -> Iterator[None]:
    """Graph capture: the body runs once; what it held at most beyond what it leaves alive
    stays with the graph's pool. Captures into one pool share it (the caching allocator hands
    a capture the blocks an earlier one freed, on the one capture stream): the pool is the
    largest of them, which holds while each capture needs no more than the one before it
    (the engine captures the most rows first, as vLLM does). A private pool (`pool=None`) is
    the graph's alone."""
    base = ledger.live_bytes
    top = [base]
    with mock.patch.object(ledger, "_add", _watching(ledger, top)), ledger.task("graph pool"):
        yield
    need = max(0, top[0] - ledger.live_bytes)
    held = 0 if pool is None else pool.nbytes
    if need > held:
        ledger.hold("graph pool", need - held)
        if pool is not None:
            pool.nbytes = need


def _watching(ledger: DeviceLedger, top: list[int]) -> Callable[[str, int], None]:
    add = type(ledger)._add

    def watched(label: str, nbytes: int) -> None:
        add(ledger, label, nbytes)
        top[0] = max(top[0], ledger.live_bytes)

    return watched


def _in_modes(run: Callable[[Any], None], modes: tuple[Any, ...]) -> Callable[[Any], None]:
    def run_in_modes(thread: Any) -> None:
        with ExitStack() as stack:
            for m in modes:
                stack.enter_context(m)
            run(thread)

    return run_in_modes


@contextmanager
def fake_cuda(ledger: DeviceLedger, device_bytes: int, host_bytes: int) -> Iterator[None]:
    """Run the body as on a CUDA device of `device_bytes` beside `host_bytes` of RAM, with
    no data and every device byte in `ledger`."""
    import psutil

    from engine.executor import attention, nano_overlap, step_inputs, tasks
    from engine.kernels.triton_launch import Kernel
    from engine.storage import fake_bindings, inline_tasks, staging

    current = FakeStream()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    counting = Counting(ledger)
    memory = SimpleNamespace(available=host_bytes, total=host_bytes)
    properties = SimpleNamespace(
        total_memory=device_bytes, name="rehearsal", major=9, minor=0, multi_processor_count=132
    )
    cuda = torch.cuda
    patches: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_name": lambda device=None: "rehearsal",
        "get_device_properties": lambda device=None: properties,
        "mem_get_info": lambda device=None: (device_bytes, device_bytes),
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
        "synchronize": lambda device=None: ledger.complete(),
        "Stream": FakeStream,
        "Event": FakeEvent,
        "current_stream": lambda device=None: current,
        "default_stream": lambda device=None: current,
        "stream": lambda stream=None: nullcontext(),
        "graph_pool_handle": FakePool,
        "CUDAGraph": FakeGraph,
        "graph": lambda graph, pool=None, stream=None, **_: _capture(ledger, pool),
    }
    with ExitStack() as stack:
        stack.enter_context(_left_as_found())
        for cls in (FakeEvent, FakeStream):
            stack.enter_context(mock.patch.object(cls, "ledger", ledger, create=True))
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(cuda, name, value))
        stack.enter_context(mock.patch.object(nano_overlap, "Event", FakeEvent))
        stack.enter_context(mock.patch.object(ThreadPoolExecutor, "submit", inline_tasks.submit))
        stack.enter_context(mock.patch.object(inline_tasks, "CLOCK", [ledger.now]))
        stack.enter_context(mock.patch.object(inline_tasks.LazyFuture, "pending", []))
        stack.enter_context(
            mock.patch.object(ledger, "on_complete", [inline_tasks.LazyFuture.release])
        )
        stack.enter_context(mock.patch.object(tasks, "wait", inline_tasks.waiting(tasks.wait)))
        stack.enter_context(mock.patch.object(staging, "buffer_key", storage_key))
        stack.enter_context(mock.patch.object(step_inputs, "host_buffer", _real_host_buffer))
        stack.enter_context(mock.patch.object(Kernel, "launch", _noted))
        sdpa = fake_bindings.fused_attention(attention.scaled_dot_product_attention)
        stack.enter_context(mock.patch.object(attention, "scaled_dot_product_attention", sdpa))
        stack.enter_context(mock.patch.object(psutil, "virtual_memory", lambda: memory))
        for owner, name in ((DiskFile, "write"), (DiskFile, "read_into"), (DiskKVPool, "_written")):
            method = getattr(owner, name)  # a fake tensor has no bytes to move or sum
            stack.enter_context(mock.patch.object(owner, name, _skipping_fakes(method)))
        record = lambda t, stream=None: ledger.record_stream(t)  # noqa: E731
        getitem, setitem = fake_bindings.indexing(torch.Tensor.__getitem__, counting.twins)
        set_original = torch.Tensor.__setitem__

        def set_any(t: torch.Tensor, index: Any, value: Any) -> None:
            if t.device.type == "cuda":
                setitem(t, index, value)
            else:
                set_original(t, index, value)

        methods = {
            **fake_bindings.methods(),
            "record_stream": record,
            "pin_memory": lambda t, *a: t,
            "__getitem__": getitem,
            "__setitem__": set_any,
        }
        for name, method in methods.items():
            # Operators (`t[i]`, `~t`, `int(t)`) only on fake tensors: a dunder set on a class
            # and removed again leaves CPython's generic slot behind, so patched on
            # torch.Tensor, `__getitem__` left every tensor a sequence (`torch.tensor` of a list
            # of 0-d tensors then failed: "len() of a 0-d tensor", transformers' Qwen2.5-VL).
            tensor_class: type = FakeTensor if name.startswith("__") else torch.Tensor
            stack.enter_context(mock.patch.object(tensor_class, name, method))
        for name in ("tensor", "as_tensor"):
            made = fake_bindings.from_data(getattr(torch, name))
            stack.enter_context(mock.patch.object(torch, name, made))
        run = threading.Thread.run
        stack.enter_context(
            mock.patch.object(threading.Thread, "run", _in_modes(run, (fake_mode, counting)))
        )
        stack.enter_context(fake_mode)
        stack.enter_context(counting)
        yield


@contextmanager
def _left_as_found() -> Iterator[None]:
    """The process as the body found it, for the CPU runs after it: what the body counts or
    caches from the fake device is undone on exit.

    - torch's table of tensor constructors (`torch.utils._device`, cached on first use by a
      `with torch.device(...)` block) is filled before `torch.tensor` is patched: filled
      inside, it kept the patched function for good, `torch.tensor` then ignored a device
      block, and transformers built its models' rotary tables on the meta device, never
      initialised (a llama's greedy tokens changed from the fourth).
    - The Triton specializations the body met (`Kernel.note`) are forgotten: a later run's
      warm-up meets them anew, as in a fresh process.
    - The multiprocessor count read from the fake device's properties is forgotten."""
    from torch.utils import _device

    from engine.kernels import triton_attention
    from engine.kernels.triton_launch import KERNELS

    _device._device_constructors()
    met = {id(k): (set(k.specializations), k.num_compiled) for k in KERNELS}
    try:
        yield
    finally:
        for k in KERNELS:  # a kernel made inside starts as new
            specializations, k.num_compiled = met.get(id(k), (set(), 0))
            k.specializations = specializations
        triton_attention._multiprocessors.cache_clear()


def _real_host_buffer(capacity: int, pinned: bool) -> torch.Tensor:
    """A step's input arrays in real host memory whatever their size (OPT-30B's 73,728-token
    prefill stages more than SMALL_BYTES of them, and the host writes their values)."""
    with unset_fake_temporarily():
        return torch.empty(capacity, dtype=torch.uint8)


def _noted(kernel: Any, grid: tuple[int, ...], on_gpu: bool, *args: Any, **kwargs: Any) -> None:
    """A Triton launch on fake tensors: nothing runs, but the specialization a GPU would
    compile for these arguments is counted (`Kernel.note`)."""
    kernel.note(*args, **kwargs)


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)
