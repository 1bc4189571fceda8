"""Launching Triton kernels on a GPU, or through Triton's interpreter on CPU tensors.

The CUDA kernels (triton_attention.py, triton_dense.py) are written once; a launch whose
tensors are on the CPU runs them in Triton's interpreter (CI proves them so, with no GPU),
one whose tensors are on CUDA compiles them (`triton.jit`). `TRITON_INTERPRET=1` must be set
before Triton is imported for the interpreter to run Triton's own jit functions (the
reductions) that the kernels call; tests/conftest.py sets it where there is no GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    by where its tensors are."""

    def __init__(self, fn: Callable[..., None], options: dict[str, int]) -> None:
        self.fn = fn
        self.options = options

    @functools.cached_property
    def jit(self) -> Any:
        from triton.runtime.jit import JITFunction

        return JITFunction(self.fn)

    @functools.cached_property
    def interpreted(self) -> Any:
        from triton.runtime.interpreter import InterpretedFunction

        _scalar_index_fix()
        return InterpretedFunction(self.fn)

    def launch(self, grid: tuple[int, ...], on_gpu: bool, *args: Any, **kwargs: Any) -> None:
        if on_gpu:
            self.jit[grid](*args, **kwargs, **self.options)
        else:
            self.interpreted[grid](*args, **kwargs)


def kernel(**options: int) -> Callable[[Callable[..., None]], Kernel]:
    """`@kernel(num_warps=4, num_stages=2)` over a Triton kernel's source (any of Triton's launch
    options: `enable_fp_fusion=False` keeps multiplies and adds apart)."""

    def wrap(fn: Callable[..., None]) -> Kernel:
        return Kernel(fn, options)

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
