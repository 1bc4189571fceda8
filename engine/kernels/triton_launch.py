"""Launching Triton kernels on a GPU, or through Triton's interpreter on CPU tensors.

The CUDA kernels (triton_attention.py, triton_dense.py) are written once; a launch whose
tensors are on the CPU runs them in Triton's interpreter (CI proves them so, with no GPU),
one whose tensors are on CUDA compiles them (`triton.jit`). `TRITON_INTERPRET=1` must be set
before Triton is imported for the interpreter to run Triton's own jit functions (the
reductions) that the kernels call; tests/conftest.py sets it where there is no GPU.

Triton compiles a kernel once per *specialization*: its constants, its arguments' types, and
for each argument not marked otherwise whether an integer is 1 or a multiple of 16 and
whether a pointer is 16-byte aligned. A compile takes a second or more, so one met first
inside a step stalls it: the engine's warm-up (`Executor.warm_up`) meets every
specialization a plan can meet before the first request, and every `Kernel` counts the ones
it met (`num_compiled`): on a GPU the compiles Triton ran (its post-compile hook), elsewhere
(the interpreter, the rehearsal's fake device) the new specializations Triton's own binder
finds in a launch's arguments. Arguments whose value changes from step to step (sequence
counts, a table's width) are not specialized (`do_not_specialize`), so a step never meets a
new one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

try:
    import triton
except ImportError:  # no Triton: the callers fall back to torch's ops
    triton = None


def available() -> bool:
    return triton is not None


def next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


class Kernel:
    """One kernel source, compiled for the GPU (`triton.jit`, with `options`: warps and
    pipelining stages) or run by Triton's interpreter on CPU tensors, chosen at each launch
    by where its tensors are. `do_not_specialize`: arguments (by name) whose values change from
    step to step, compiled for any value; `do_not_specialize_on_alignment`: pointers whose
    alignment does (views at varying offsets), compiled for any alignment."""

    def __init__(
        self,
        fn: Callable[..., None],
        options: dict[str, int],
        do_not_specialize: Iterable[str] = (),
        do_not_specialize_on_alignment: Iterable[str] = (),
    ) -> None:
        self.fn = fn
        self.options = options
        self.do_not_specialize = tuple(do_not_specialize)
        self.do_not_specialize_on_alignment = tuple(do_not_specialize_on_alignment)
        self.specializations: set[Any] = set()
        """The specializations met off the GPU (Triton's binder's keys)."""
        self.num_compiled = 0
        """Specializations compiled (on a GPU) or met first (elsewhere): a new one after the
        engine's warm-up is a compile inside a step."""
        KERNELS.append(self)

    @functools.cached_property
    def jit(self) -> Any:
        from triton.runtime.jit import JITFunction

        _count_compiles()
        jit = JITFunction(
            self.fn,
            do_not_specialize=list(self.do_not_specialize),
            do_not_specialize_on_alignment=list(self.do_not_specialize_on_alignment),
        )
        _BY_JIT[id(jit)] = self
        return jit

    @functools.cached_property
    def interpreted(self) -> Any:
        from triton.runtime.interpreter import InterpretedFunction

        _scalar_index_fix()
        _patch_language_once_per_launch()
        return InterpretedFunction(self.fn)

    @functools.cached_property
    def _binder(self) -> Any:
        """Triton's own binder of this kernel's launch arguments (what its JIT keys its cache
        on), built for the base backend: it needs no GPU."""
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import create_function_from_signature

        return create_function_from_signature(self.jit.signature, self.jit.params, BaseBackend)

    def note(self, *args: Any, **kwargs: Any) -> None:
        """Count the launch's specialization if it is new (off the GPU: what a GPU would
        compile for these arguments)."""
        _, specialization, options = self._binder(*args, **kwargs, **self.options)
        key = (tuple(specialization), tuple(sorted(options.items())))
        if key not in self.specializations:
            self.specializations.add(key)
            self.num_compiled += 1

    def launch(self, grid: tuple[int, ...], on_gpu: bool, *args: Any, **kwargs: Any) -> None:
        if on_gpu:
            self.jit[grid](*args, **kwargs, **self.options)
        else:
            self.note(*args, **kwargs)
            self.interpreted[grid](*args, **kwargs)


KERNELS: list[Kernel] = []
"""Every kernel made (`num_compiled` summed over them: `compiled_count`)."""
_BY_JIT: dict[int, Kernel] = {}


def compiled_count() -> int:
    """Specializations compiled (or met, off the GPU) so far by all kernels."""
    return sum(k.num_compiled for k in KERNELS)


@functools.cache
def _count_compiles() -> None:
    """Count each compile Triton's JIT runs for one of our kernels (its post-compile hook,
    chained to any hook set before)."""
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook

    def counted(*args: Any, **kwargs: Any) -> Any:
        kernel = _BY_JIT.get(id(kwargs["fn"].jit_function))
        if kernel is not None:
            kernel.num_compiled += 1
        return before(*args, **kwargs) if before is not None else None

    knobs.runtime.jit_post_compile_hook = counted


def kernel(
    do_not_specialize: Iterable[str] = (), **options: int
) -> Callable[[Callable[..., None]], Kernel]:
    """`@kernel(num_warps=4, num_stages=2)` over a Triton kernel's source (any of Triton's launch
    options: `enable_fp_fusion=False` keeps multiplies and adds apart; `do_not_specialize`:
    the arguments whose values change from step to step)."""

    def wrap(fn: Callable[..., None]) -> Kernel:
        return Kernel(fn, options, do_not_specialize)

    return wrap


@functools.cache
def _scalar_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with `int()` of a one-element
    array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"), so a loop
    over a runtime range fails there (triton-lang/triton#9171, fixed after 3.6): its scalars
    are given an `__index__` that reads the one element."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "nanoflex_fixed", False):
        return

    def fixed(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    fixed.nanoflex_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = fixed


@functools.cache
def _patch_language_once_per_launch() -> None:
    """Triton 3.6's interpreter patches triton.language for the interpreter (`_patch_lang`:
    `inspect.getmembers` over the language's modules and classes) at every call of a device
    function (a `@triton.jit` helper such as `_attend_tile`, or Triton's own `tl.max` and
    `tl.sum`), in every program of the grid: a third of the CPU time of an interpreted decode
    launch (one of tests/engine/kernels/test_triton_attention.py's patched 1192 times).
    Nothing undoes those patches before the launch ends (only the launch's own are restored,
    then), so within a launch the first call of each device function patches what every
    later call would patch again with the same wrappers: later calls skip it (the outputs are
    bit for bit the same)."""
    from triton.runtime import interpreter

    launch_grid = interpreter.GridExecutor.__call__
    call_device = interpreter.InterpretedFunction.__call__
    patched: set[Any] = set()
    """The device functions whose patches are in place in the launch running."""

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.clear()
        try:
            return launch_grid(self, *args, **kwargs)
        finally:
            patched.clear()

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fn not in patched:
            patched.add(self.fn)
            return call_device(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = call
