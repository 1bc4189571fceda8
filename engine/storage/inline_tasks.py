"""The engine's worker pools run in the submitting thread, for the rehearsal of the CUDA path
(engine/storage/fake_cuda.py: fake tensors are not safe across threads)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class LazyFuture(Future[Any]):
    """A store handed to a store thread, run only when someone waits for it: the store
    threads as slow as they can be, so what a queued store keeps alive on the device is
    held for as long as it could be."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        super().__init__()
        self._call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = (
            fn,
            args,
            kwargs,
        )

    def run_now(self) -> None:
        if self._call is None:
            return
        fn, args, kwargs = self._call
        self._call = None
        try:
            self.set_result(fn(*args, **kwargs))
        except BaseException as e:
            self.set_exception(e)

    def result(self, timeout: float | None = None) -> Any:
        self.run_now()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.run_now()
        return super().exception(timeout)


def submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`ThreadPoolExecutor.submit`, run here: at once, as a thread that is never behind would,
    except a store pool's tasks, which run when waited for (`LazyFuture`)."""
    if "store" in getattr(pool, "_thread_name_prefix", ""):
        return LazyFuture(fn, args, kwargs)
    future: Future[Any] = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:
        future.set_exception(e)
    return future


def waiting(wait: Callable[..., Any]) -> Callable[..., Any]:
    """`concurrent.futures.wait` that first runs the lazy futures it is given."""

    def wait_lazy(futures: Any, *args: Any, **kwargs: Any) -> Any:
        for f in futures:
            if isinstance(f, LazyFuture):
                f.run_now()
        return wait(futures, *args, **kwargs)

    return wait_lazy
