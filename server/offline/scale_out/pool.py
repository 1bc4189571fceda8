"""`ReplicaPool`: N `Replica` actors answering a batch's pending lines, shard by shard.

The lines are cut into shards, held in one queue. Each replica runs `LANES_PER_REPLICA`
shards at once (while one finishes, the next is already queued in its engine, so the
engine's block never drains at a shard boundary) and streams every answered line back
as soon as it is done; the driver records it (output or error file, flush + fsync)
right away. When an actor is lost (killed, its node gone), the lines of its shards that
did not come back go back in the queue, and a new actor takes its place; a line is
recorded once, whoever answers it. Resuming after a lost driver is the run-batch's own:
the files hold every line recorded so far, and the next run skips them.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.core.engine_args import EngineArgs
from server.offline.scale_out.replica import Replica, ReplicaInfo
from server.offline.work import BatchWork, Pending, Record, RunBatchError

LANES_PER_REPLICA = 2
"""Shards in flight per replica."""
MAX_SHARD_LINES = 1024
"""Most lines in one shard (what a lost actor can take down with it, at most, per lane)."""
ACTOR_NAME_PREFIX = "nanoflex-replica-"
"""Replica actors are named `<prefix><run>-<replica>.<generation>` (the Ray dashboard shows
them; `ray.get_actor` finds them)."""


@dataclass(slots=True)
class _Slot:
    """One of the pool's N places: the actor in it now, and how many came before."""

    index: int
    actor: Any = None
    """The actor's handle."""
    generation: int = 0
    """Actors started in this slot so far (the current one included)."""
    info: ReplicaInfo | None = None
    num_answered: int = 0
    """Lines this slot's actors answered in this run (recorded ones only)."""
    lock: asyncio.Lock | None = None
    """Held while the slot's actor is replaced, so its lanes replace it once."""


class ReplicaPool:
    """`num_replicas` actors of `Replica(engine_args)` on the connected Ray cluster."""

    def __init__(
        self,
        ray: Any,
        engine_args: EngineArgs,
        num_replicas: int,
        *,
        gpus_per_replica: float = 0,
        cpus_per_replica: float = 1,
        max_lost: int | None = None,
        model_name: str | None = None,
    ) -> None:
        if num_replicas < 1:
            raise RunBatchError(f"--replicas must be >= 1, got {num_replicas}")
        self.ray = ray
        self.engine_args = engine_args
        self.model_name = model_name
        """The id requests name (`--served-model-name`); None: the model reference."""
        self.max_lost = 3 * num_replicas if max_lost is None else max_lost
        """Actors that may be lost in one run before it gives up (rerun to resume)."""
        self.num_lost = 0
        self.run_name = f"{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        self._actor_class = ray.remote(Replica)
        self._actor_options = dict(
            num_cpus=cpus_per_replica,
            num_gpus=gpus_per_replica,
            max_concurrency=LANES_PER_REPLICA + 1,
            max_restarts=0,  # a lost actor is replaced by the pool, its lines re-queued
            scheduling_strategy="SPREAD",
        )
        self.slots = [_Slot(index=i) for i in range(num_replicas)]
        self._recorded: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every replica and wait until each one's engine is up."""
        for slot in self.slots:
            slot.lock = asyncio.Lock()
        await asyncio.gather(*(self._start(slot) for slot in self.slots))
        for slot in self.slots:
            assert slot.info is not None
            info = slot.info
            policy = info.policy
            print(
                f"run-batch: replica {slot.index} on {info.host} (pid {info.pid}): block "
                f"{policy['gpu_batch_size']} x {policy['num_gpu_batches']}, weights on "
                f"gpu/cpu/disk {'/'.join(str(f) for f in policy['weights_frac'])}",
                file=sys.stderr,
            )

    def shutdown(self) -> None:
        for slot in self.slots:
            if slot.actor is not None:
                self.ray.kill(slot.actor)
                slot.actor = None

    async def _start(self, slot: _Slot) -> None:
        """A new actor in `slot`, up and described; an engine that fails to start ends the run."""
        errors = self.ray.exceptions
        while True:
            name = f"{ACTOR_NAME_PREFIX}{self.run_name}-{slot.index}.{slot.generation}"
            options = {**self._actor_options, "name": name}
            slot.actor = self._actor_class.options(**options).remote(
                self._engine_args(slot), self.model_name
            )
            slot.generation += 1
            try:
                slot.info = await slot.actor.describe.remote()
                return
            except errors.RayActorError as e:
                if getattr(e, "actor_init_failed", False):
                    raise RunBatchError(
                        f"replica {slot.index} could not start its engine: {_last_line(e)}"
                    ) from e
                self._count_lost(slot, e)  # lost while starting (its node went away)

    def _engine_args(self, slot: _Slot) -> EngineArgs:
        """Each replica its own disk tier: replicas that share a machine must not share files."""
        if self.engine_args.offload_dir is None:
            return self.engine_args
        offload_dir = Path(self.engine_args.offload_dir) / f"replica-{slot.index}"
        return replace(self.engine_args, offload_dir=str(offload_dir))

    def _count_lost(self, slot: _Slot, error: BaseException) -> None:
        self.num_lost += 1
        print(
            f"run-batch: replica {slot.index} was lost ({_last_line(error)}); its unanswered "
            "lines go back in the queue and a new replica takes its place",
            file=sys.stderr,
        )
        if self.num_lost > self.max_lost:
            raise RunBatchError(
                f"{self.num_lost} replicas were lost in this run, the last with: "
                f"{_last_line(error)}. Rerun the same command to resume."
            )

    # -- running ---------------------------------------------------------------------------

    def shard_lines(self, num_lines: int) -> int:
        """Lines per shard: enough for every lane of every replica to have work, at most
        the largest block a replica runs (a shard then fills it), at most MAX_SHARD_LINES."""
        blocks = [slot.info.block_size for slot in self.slots if slot.info is not None]
        largest = min(max(blocks, default=1), MAX_SHARD_LINES)
        even = math.ceil(num_lines / (len(self.slots) * LANES_PER_REPLICA))
        return max(1, min(largest, even))

    async def run(self, work: BatchWork, record: Record) -> None:
        """Start the replicas and answer every line of `work`."""
        await self.start()
        await self.answer(work, record)

    async def answer(self, work: BatchWork, record: Record) -> None:
        """Answer every line of `work` on the started replicas, recording each exactly once."""
        size = self.shard_lines(len(work.todo))
        shards: asyncio.Queue[list[Pending]] = asyncio.Queue()
        for start in range(0, len(work.todo), size):
            shards.put_nowait(work.todo[start : start + size])
        done = asyncio.Event()
        num_left = [len(work.todo)]

        def record_once(slot: _Slot, line_id: str, ok: bool, line: str) -> None:
            if line_id in self._recorded:
                return
            self._recorded.add(line_id)
            record(ok, line)
            slot.num_answered += 1
            num_left[0] -= 1
            if num_left[0] == 0:
                done.set()

        lanes = [
            asyncio.create_task(self._lane(slot, work, shards, record_once))
            for slot in self.slots
            for _ in range(LANES_PER_REPLICA)
        ]
        finished = asyncio.create_task(done.wait())
        try:
            while not done.is_set():
                ended, _ = await asyncio.wait([finished, *lanes], return_when="FIRST_COMPLETED")
                for task in ended:
                    if task is not finished:
                        task.result()  # a lane ends only by raising: the run's error
        finally:
            for task in [finished, *lanes]:
                task.cancel()
            await asyncio.gather(finished, *lanes, return_exceptions=True)
        counts = ", ".join(f"replica {s.index} {s.num_answered}" for s in self.slots)
        print(f"run-batch: lines answered by {counts}; {self.num_lost} lost", file=sys.stderr)

    async def _lane(
        self, slot: _Slot, work: BatchWork, shards: asyncio.Queue[list[Pending]], record: Any
    ) -> None:
        """Take shards from the queue and run them on `slot`'s actor, for ever."""
        errors = self.ray.exceptions
        while True:
            shard = await shards.get()
            actor, generation = slot.actor, slot.generation
            answered: set[str] = set()
            try:
                stream = actor.answer.options(num_returns="streaming").remote(
                    BatchWork(work.endpoint, work.created, shard)
                )
                async for ref in stream:
                    line_id, ok, line = await ref
                    answered.add(line_id)
                    record(slot, line_id, ok, line)
            except errors.RayActorError as e:
                rest = [item for item in shard if item.line_id not in answered]
                if rest:
                    shards.put_nowait(rest)
                await self._replace(slot, generation, e)
            except errors.RayTaskError as e:  # the engine failed (not the actor)
                raise RunBatchError(
                    f"replica {slot.index} failed: {_last_line(e)} Rerun the same command "
                    "to resume."
                ) from e

    async def _replace(self, slot: _Slot, generation: int, error: BaseException) -> None:
        """A new actor for `slot`, unless its other lane already put one there."""
        assert slot.lock is not None
        async with slot.lock:
            if slot.generation != generation:
                return
            self._count_lost(slot, error)
            self.ray.kill(slot.actor)  # nothing if it is gone; certain if it is half-alive
            await self._start(slot)


def _last_line(error: BaseException) -> str:
    """The last non-blank line of an error's text (Ray's carry the remote traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
