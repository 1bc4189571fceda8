"""`start`: run a task on a worker thread, or right here when there is none (or no need);
`wait_all`: wait for tasks to end, failed or not."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Launch(Protocol):
    """Starts a load or store: on a copy thread when it has bytes to move, else inline."""

    def __call__(self, moves: bool, fn: Callable[..., T], *args: Any) -> Future[T]: ...


def start(thread: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run `fn` on `thread`, or now in this thread when None, as a finished future whose
    error, if any, goes to whoever waits, as a pool's would (on CUDA its kernels still run
    asynchronously, on whatever stream `fn` makes current)."""
    if thread is not None:
        return thread.submit(fn, *args)
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)
    return future


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Return once every one of `futures` has ended, whatever its outcome."""
    wait(list(futures))
