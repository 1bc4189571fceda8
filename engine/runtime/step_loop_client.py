"""`StepLoopClient`: the daemon's engine: the scheduler here, the executor in its own process.

Building the client is cheap: `start()` resolves the model (building its directory on
first use), plans the policy and loads the weights in the engine process, saying what it
does in `status()` and the log, so the daemon can answer /health and /ready meanwhile.
A failure there raises `EngineStartError` with one line; nothing is retried.

One worker thread owns the `Scheduler` and `StepLoop` (neither is thread-safe)
and steps them (`EngineWorker`); the asyncio side talks to it only through a command queue
and gets each step's deltas back in one `call_soon_threadsafe` (`RequestStreams`). A
request for n choices is fanned out here (`ParentRequest`): the engine runs each choice as
a request of its own. If the engine process dies, the client reports not-ready, restarts it
with a fresh scheduler (back-off and a limit: engine/runtime/restarts.py) and fails the
requests that were in flight with `EngineDeadError` (batch work is retried by the batch
runner, so batch jobs lose nothing; online callers see a 503). Past the limit it gives up
and calls its fatal listeners.

Capacity is fixed when the engine first starts (`EngineCapacity`). A step that fails on the
offload storage is no crash: the scheduler recomputes its sequences (`Scheduler.recover`); a
request that keeps failing there ends with `StorageUnavailableError`, and while no tier can
take KV the client is not ready. Each step's figures feed /metrics (`EngineMetrics`).

The client's roles, each its own module: its lifecycle (here: start, shutdown, readiness),
the worker loop and its restarts (engine_worker.py), the tokenizer and the model's limits
(here, read at start: model_facts.py), metrics (step_metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.core.media import SeqMedia, VisionSpec
from engine.core.model_files import resolve_model_dir, served_model_name
from engine.core.outputs import SequenceDelta
from engine.core.parent_request import ParentRequest
from engine.core.pooling import PoolingSpec
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY, Request
from engine.core.step_loop import StepLoop
from engine.core.tokenizer import ChatOptions, Tokenizer
from engine.runtime.engine_capacity import EngineCapacity
from engine.runtime.engine_client import EngineClient, EngineDeadError, StorageUnavailableError
from engine.runtime.engine_process import ExecutorProcess
from engine.runtime.engine_worker import Command, EngineWorker, WorkerHooks
from engine.runtime.executor_client import EXECUTOR_FACTORY, ExecutorClient, InProcessExecutor
from engine.runtime.model_facts import ModelFacts
from engine.runtime.pooled_requests import pair_input, run_pooled
from engine.runtime.pooling_client import pooling_client_for
from engine.runtime.request_streams import RequestStreams
from engine.runtime.restarts import RestartPolicy, RestartTracker
from engine.runtime.step_metrics import EngineMetrics, StepCounter
from policy import Policy

log = logging.getLogger("nanoflex.engine")


class EngineStartError(UserError):
    """The engine could not start (bad model, no device, out of memory at load); one line."""


class StepLoopClient(EngineClient):
    """The scheduler in this process, the executor in the engine process (or in this one
    with `in_process`). `model_dir` and `policy` are resolved by `start()` when None;
    `serves_online`: online requests may come (the daemon), so the scheduler keeps every step's
    batch prefill short (`EngineArgs.batch_step_cap`); False for a batch-only engine."""

    def __init__(
        self,
        engine_args: EngineArgs,
        model_dir: Path | None = None,
        policy: Policy | None = None,
        *,
        model_name: str,
        in_process: bool = False,
        restarts: RestartPolicy | None = None,
        executor_factory: str = EXECUTOR_FACTORY,
        serves_online: bool = True,
    ) -> None:
        super().__init__()
        self.serves_online = serves_online
        self.executor_factory = executor_factory
        """'module:function' building the executor from the `EngineArgs` record, the model
        directory and the policy (`engine.executor.executor.build_executor`)."""
        self.engine_args, self.model_dir, self.policy = engine_args, model_dir, policy
        self._model_name = model_name
        self._in_process = in_process
        self._restarts = RestartTracker(restarts or RestartPolicy())
        self._tokenizer: Tokenizer | None = None
        self._facts = ModelFacts()
        """The model's limits and defaults, read with the tokenizer at start."""
        self._executor: ExecutorClient | None = None
        self._status = "waiting to start"
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams = RequestStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: EngineWorker | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loading = threading.Event()
        self._capacity = EngineCapacity()
        self._metrics = EngineMetrics()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loading.set()
        try:
            await asyncio.to_thread(self._load)
        except UserError as e:
            raise EngineStartError(str(e)) from e
        finally:
            self._loading.clear()
        if self._stopping.is_set():
            return
        assert self._executor is not None and self.policy is not None
        try:
            info = self._executor.describe()
            self._metrics.took(info)
            self._executor.kwargs["args"] = self._capacity.fix(
                info, self.policy, self._facts.max_model_len, self.engine_args
            )
        except UserError as e:
            await asyncio.to_thread(self._executor.shutdown)
            raise EngineStartError(str(e)) from e
        self._worker = EngineWorker(
            self._executor,
            self._commands,
            self._restarts,
            self._metrics,
            (self._ready, self._stopping),
            self._worker_hooks(),
        )
        self._worker.start()
        self._set_status("ready")
        self._ready.set()

    def _load(self) -> None:
        """Resolve the model and the policy, read the tokenizer, start the executor."""
        args = self.engine_args
        if self.model_dir is None:
            self._set_status(f"finding model {self._model_name} (built on first use)")
            self.model_dir = resolve_model_dir(args.model)
        if self.policy is None:
            self._set_status("planning the policy (the first run on a machine profiles it)")
            self.policy, plan = args.resolve_policy(self.model_dir)
            if plan:
                log.info("planned from the hardware profile %s", plan["hardware"])
            log.info("policy %s%s", self.policy.to_json(), f" planned: {plan}" if plan else "")
        self._set_status("reading the tokenizer")
        tokenizer = Tokenizer(self.model_dir)
        self._facts = ModelFacts.read(self.model_dir, args)
        self._tokenizer = tokenizer  # last: requests are prepared once it is set
        kwargs = {"args": args, "model_dir": str(self.model_dir), "policy": self.policy}
        self._executor = (
            InProcessExecutor(self.executor_factory, kwargs, on_progress=self._set_status)
            if self._in_process
            else ExecutorProcess(
                self.executor_factory, kwargs, on_progress=self._set_status, nice=args.engine_nice
            )
        )
        if self._stopping.is_set():
            return
        self._set_status(f"loading {self.model_dir.name} in the engine process")
        try:
            self._executor.start()
        except Exception:
            if self._stopping.is_set():  # shut down while loading: not a start failure
                return
            raise

    def _worker_hooks(self) -> WorkerHooks:
        return WorkerHooks(
            build_step_loop=self._new_step_loop,
            check_restarted=self._check_restarted,
            set_status=self._set_status,
            report=self.emit_step,
            give_up=self.emit_fatal,
            to_loop=self._call_soon,
            deliver=self._dispatch,
            fail_all=self._streams.fail_all,
        )

    async def shutdown(self) -> None:
        self._stopping.set()
        if self._loading.is_set() and self._executor is not None:
            self._executor.abort_start()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join)
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown)
        self._ready.clear()

    def is_ready(self) -> bool:
        return self._is_up() and not self._storage_blocked()

    def check_ready(self) -> None:
        if not self._is_up():
            raise EngineDeadError("the engine is not ready")
        if self._storage_blocked():
            raise StorageUnavailableError(self.status())

    def _is_up(self) -> bool:
        return self._ready.is_set() and self._executor is not None and self._executor.is_alive

    @property
    def _step_loop(self) -> StepLoop | None:
        """The step loop now stepping (a snapshot from any thread)."""
        return None if self._worker is None else self._worker.step_loop

    def _storage_blocked(self) -> bool:
        """No KV tier that holds a longest sequence may be used now (its storage failed a
        moment ago): read from any thread, a snapshot."""
        core = self._step_loop
        return core is not None and core.scheduler.is_blocked_by_storage()

    def status(self) -> str:
        core = self._step_loop
        if self._is_up() and core is not None and self._storage_blocked():
            scheduler = core.scheduler
            return (
                f"the engine's offload storage failed ({scheduler.rest.last_fault}); it is "
                f"tried again in {scheduler.rest.left():.0f} s"
            )
        return self._status

    def _set_status(self, text: str) -> None:
        if text != self._status:
            log.info("engine: %s", text)
        self._status = text

    def _check_restarted(self) -> None:
        """A restarted engine must have the capacity the first one announced."""
        assert self._executor is not None
        info = self._executor.describe()
        self._metrics.took(info)
        self._capacity.check_restarted(info)

    def _new_step_loop(self, counter: StepCounter) -> StepLoop:
        """A fresh scheduler and step loop stepping the executor through `counter`."""
        assert self.policy is not None and self.model_dir is not None and self._executor
        scheduler = self.engine_args.create_scheduler(
            self.policy,
            self.model_dir,
            self._executor.describe(),
            self._tokenizer,
            self.serves_online,
        )
        on_cpu_here = self._in_process and self._executor.describe().placement.device == "cpu"
        return StepLoop(scheduler, counter, self.engine_args.plans_ahead(on_cpu_here))

    def _loaded(self) -> Tokenizer:
        """The tokenizer, once `start()` has read it; before, the engine is unavailable."""
        if self._tokenizer is None:
            raise EngineDeadError(f"the model is not loaded yet ({self._status})")
        return self._tokenizer

    # -- model and tokenizer ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        self._loaded()
        return self._facts.max_model_len

    @property
    def vision(self) -> VisionSpec | None:
        self._loaded()
        return self._facts.vision

    @property
    def vocab_size(self) -> int:
        return self._loaded().vocab_size

    @property
    def max_token_bytes(self) -> int:
        self._loaded()
        return self._facts.max_token_bytes

    @property
    def eos_token_id(self) -> int | None:
        return self._loaded().eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._loaded().encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._loaded().decode(token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        return self._loaded().apply_chat_template(messages, options)

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        self._loaded()
        return self._facts.generation_defaults

    def tokenizer_info(self) -> dict[str, Any]:
        return {**self._loaded().info(), "model_max_length": self.max_model_len}

    # -- generation ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = ONLINE_PRIORITY,
        *,
        stream: bool = True,
        media: SeqMedia | None = None,
    ) -> AsyncGenerator[SequenceDelta, None]:
        self.check_ready()
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            priority,
            media=media,
            final_only=not stream,
        )
        parent = ParentRequest(request)
        child_ids = [child.request_id for child in parent.children]
        deltas = self._streams.open(request_id, child_ids)
        reply: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self._commands.put(("add", (parent.children, reply)))
        unfinished = set(child_ids)
        try:
            error = await reply  # the scheduler's verdict on the request (e.g. too long)
            if error is not None:
                unfinished.clear()  # none of them was queued
                raise error
            tag = parent.tag if len(child_ids) > 1 else None  # n == 1: its index is 0
            while unfinished:
                for item in await deltas.take():
                    if isinstance(item, Exception):
                        raise item
                    if item.finish_reason is not None:
                        unfinished.discard(item.request_id)
                    yield item if tag is None else tag(item)
        finally:
            self._streams.close(request_id, child_ids)
            if unfinished:
                self._commands.put(("abort", sorted(unfinished)))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", self._streams.children_of(request_id)))

    def _dispatch(self, deltas: list[SequenceDelta]) -> None:
        """On the event loop: one step's deltas to their requests' streams."""
        self._streams.dispatch(deltas)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    # -- pooling (a decoder embedder or reranker: engine/runtime/pooled_requests.py) ---------

    @property
    def pooling_spec(self) -> PoolingSpec | None:
        self._loaded()
        return self._facts.pooling

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        spec = self.pooling_spec
        if spec is None or spec.task != "score":
            return super().encode_pair(first, second)
        return pair_input(spec, self, first, second)

    async def embed(
        self, inputs: list[list[int]], priority: int = ONLINE_PRIORITY
    ) -> list[list[float]]:
        return await run_pooled(self, inputs, priority)

    async def score(
        self, pairs: list[tuple[list[int], list[int]]], priority: int = ONLINE_PRIORITY
    ) -> list[float]:
        outputs = await run_pooled(self, [ids for ids, _ in pairs], priority)
        return [output[0] for output in outputs]


def build_engine_client(args: argparse.Namespace) -> EngineClient:
    """`nanoflex serve`'s engine, not started: nothing is loaded until `start()`. A local
    directory of a pooling model gets the pooling engine (engine/runtime/pooling_client.py)."""
    pooling = pooling_client_for(args)
    if pooling is not None:
        return pooling
    engine_args = EngineArgs.from_cli_args(args)
    name = getattr(args, "served_model_name", None) or served_model_name(engine_args.model)
    return StepLoopClient(
        engine_args, model_name=name, in_process=getattr(args, "in_process", False)
    )
