"""`start`: run a task on a worker thread, or right here when there is none (or no need);
`wait_all`: wait for tasks to end, failed or not. A task is a `Task`: a pool's `Future`, or
`Done` for one that ran here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Task(Protocol[T_co]):
    """A started task's outcome: its value, or its error raised, once it has ended."""

    def result(self) -> T_co: ...


class Done(Generic[T]):
    """A task that ran here and has ended: its value or its error. No lock, condition or
    callbacks as a `Future` has: a resident step launches a few thousand of these (every
    (layer, batch)'s loads and stores, none moving a byte), and a `Future` each took ~40
    Python calls (a resident float32 decode step's host time grew by about 5% with them)."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: T, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value


class Launch(Protocol):
    """Starts a load or store: on a copy thread when it has bytes to move, else inline."""

    def __call__(self, moves: bool, fn: Callable[..., T], *args: Any) -> Task[T]: ...


def start(thread: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> Task[T]:
    """Run `fn` on `thread`, or now in this thread when None, as a `Done` whose error, if
    any, goes to whoever waits, as a pool's would (on CUDA its kernels still run
    asynchronously, on whatever stream `fn` makes current)."""
    if thread is not None:
        return thread.submit(fn, *args)
    try:
        return Done(fn(*args))
    except BaseException as e:
        return Done[T](None, e)  # type: ignore[arg-type]  # never read: result() raises


def wait_all(tasks: Iterable[Task[Any]]) -> None:
    """Return once every one of `tasks` has ended, whatever its outcome (a `Done` has)."""
    wait([task for task in tasks if isinstance(task, Future)])
