"""`RequestStreams`: where each request's deltas go on the daemon's event loop, torch-free.

A request of n choices runs in the engine as n child requests (`ParentRequest`); their
deltas all go to the one `DeltaStream` its `generate` reads. Everything here runs on the
event loop: the worker thread hands each step's deltas over in one `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio

from engine.core.outputs import SequenceDelta
from engine.runtime.engine_client import StorageUnavailableError


class DeltaStream:
    """Where one request's deltas go, on the event loop: a list and the future its reader
    waits on (an `asyncio.Queue` does more per item than a stream of one item a step needs:
    task counting, a deque of getters)."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: list[SequenceDelta | Exception] = []
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop

    def put(self, item: SequenceDelta | Exception) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    async def take(self) -> list[SequenceDelta | Exception]:
        """Every item put since the last call, once there is one."""
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


class RequestStreams:
    """The stream of every request in flight, by its children's ids (event loop only)."""

    def __init__(self) -> None:
        self._streams: dict[str, DeltaStream] = {}
        """Engine request (child) id -> its parent's stream."""
        self._children: dict[str, list[str]] = {}
        """Parent request id -> its children's ids, while it runs."""

    def open(self, request_id: str, child_ids: list[str]) -> DeltaStream:
        """The stream a request's children's deltas go to, until `close`."""
        stream = DeltaStream(asyncio.get_running_loop())
        for child_id in child_ids:
            self._streams[child_id] = stream
        self._children[request_id] = child_ids
        return stream

    def close(self, request_id: str, child_ids: list[str]) -> None:
        """Forget a request that ended (or was left): later deltas of it are dropped."""
        for child_id in child_ids:
            self._streams.pop(child_id, None)
        self._children.pop(request_id, None)

    def children_of(self, request_id: str) -> list[str]:
        """The engine requests a request runs as (the id itself when not in flight here)."""
        return self._children.get(request_id, [request_id])

    def dispatch(self, deltas: list[SequenceDelta]) -> None:
        """One step's deltas to their requests' streams. A request that does not stream is
        final-only in the engine: it hears once per choice, with all of it (no task wakes
        per token)."""
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.retryable:  # the engine's storage failed it: not the request's answer
                stream.put(StorageUnavailableError(delta.error or "storage failed"))
                continue
            stream.put(delta)

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with `error`."""
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.put(error)
