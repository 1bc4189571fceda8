"""The engine's worker pools run in the submitting thread, for the rehearsal of the CUDA path
(engine/fake_cuda.py: fake tensors are not safe across threads)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

CLOCK: list[Callable[[], int]] = [lambda: 0]
"""The device ledger's clock (engine/storage/device_ledger.py), set by the rehearsal."""


class LazyFuture(Future[Any]):
    """A store handed to a store thread, run when someone waits for it or once the host has
    seen the device get past the moment it was handed over (`release`): a store thread
    waits for the device, so what a queued store keeps alive on the device is held for as
    long as the device lags the host."""

    pending: ClassVar[list[LazyFuture]] = []
    """Not yet run, oldest first."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        super().__init__()
        self.clock = CLOCK[0]()
        LazyFuture.pending.append(self)
        self._call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = (
            fn,
            args,
            kwargs,
        )

    @classmethod
    def release(cls, clock: int) -> None:
        """Run the stores handed over before the device reached `clock`."""
        ready = [f for f in cls.pending if f.clock <= clock]
        cls.pending = [f for f in cls.pending if f.clock > clock]
        for future in ready:
            future.run_now()

    def run_now(self) -> None:
        if self._call is None:
            return
        if self in LazyFuture.pending:
            LazyFuture.pending.remove(self)
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
