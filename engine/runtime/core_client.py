"""`CoreEngineClient`: the daemon's engine: the scheduler here, the executor in its own process.

Building the client is cheap: `start()` resolves the model (building its directory on
first use), plans the policy and loads the weights in the engine process, saying what it
does in `status()` and the log, so the daemon can answer /health and /ready meanwhile.
A failure there raises `EngineStartError` with one line; nothing is retried.

One worker thread owns the `Scheduler` and `EngineCore` (neither is thread-safe)
and steps them; the asyncio side talks to it only through a command queue and
gets each step's deltas back in one `call_soon_threadsafe`. A request for n choices is
fanned out here (`ParentRequest`): the engine runs each choice as a request of its own.
If the engine process dies, the client reports not-ready, restarts it with a fresh
scheduler (back-off and a limit: engine/runtime/restarts.py) and fails the requests that
were in flight with `EngineDeadError` (batch work is retried by the batch runner, so batch
jobs lose nothing; online callers see a 503). Past the limit it gives up and calls its
fatal listeners.

Capacity is fixed when the engine first starts: the budgets it derived (or was given) are
passed to every restarted engine, and one that reports less KV capacity than the first is
not taken. A first engine whose KV pools cannot hold one sequence of the context length does
not start. A step that fails on the offload storage is no crash: the scheduler recomputes
its sequences (`Scheduler.recover`); a request that keeps failing there ends with
`StorageUnavailableError`, and while no tier can take KV the client is not ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.core.engine_args import EngineArgs
from engine.core.engine_core import EngineCore
from engine.core.media import SeqMedia, VisionSpec
from engine.core.model_files import generation_defaults, resolve_model_dir, served_model_name
from engine.core.outputs import SequenceDelta
from engine.core.parent_request import ParentRequest
from engine.core.pooling import PoolingSpec, pooling_spec
from engine.core.protocol import EngineInfo, StepPlan, StepResult
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY, Request
from engine.core.tier_rest import largest_pool_tokens
from engine.core.tokenizer import ChatOptions, Tokenizer
from engine.runtime.engine_client import (
    EngineClient,
    EngineDeadError,
    StepStats,
    StorageUnavailableError,
)
from engine.runtime.engine_process import ExecutorProcess
from engine.runtime.executor_client import (
    EXECUTOR_FACTORY,
    ExecutorClient,
    ExecutorDiedError,
    InProcessExecutor,
)
from engine.runtime.pooled_requests import pair_input, run_pooled
from engine.runtime.pooling_client import pooling_client_for
from engine.runtime.restarts import RestartPolicy, RestartTracker
from policy import TIERS, Policy
from policy.errors import UserError

log = logging.getLogger("nanoflex.engine")

_IDLE_WAIT_S = 0.05


class EngineStartError(UserError):
    """The engine could not start (bad model, no device, out of memory at load); one line."""


class CoreEngineClient(EngineClient):
    """The scheduler in this process, the executor in the engine process (or in this one
    with `in_process`). `model_dir` and `policy` are resolved by `start()` when None."""

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
    ) -> None:
        super().__init__()
        self.executor_factory = executor_factory
        """'module:function' building the executor from the `EngineArgs` record, the model
        directory and the policy (`engine.executor.executor.build_executor`)."""
        self.engine_args, self.model_dir, self.policy = engine_args, model_dir, policy
        self._model_name = model_name
        self._in_process = in_process
        self._restarts = RestartTracker(restarts or RestartPolicy())
        self._tokenizer: Tokenizer | None = None
        self._executor: ExecutorClient | None = None
        self._max_model_len = 0
        self._max_token_bytes = 0
        self._generation_defaults: dict[str, float | int] = {}
        self._pooling: PoolingSpec | None = None
        """A decoder pooling model's spec (engine/core/pooling.py); None: it generates."""
        self._vision: VisionSpec | None = None
        self._status = "waiting to start"
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        """Engine request (child) id -> its parent's stream (touched on the event loop only)."""
        self._children: dict[str, list[str]] = {}
        """Parent request id -> its children's ids, while it runs."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._loading = threading.Event()
        self._core: EngineCore | None = None
        self._preemptions_before = 0
        self._counter: _StepCounter | None = None
        self._reported_busy = False
        self._capacity: dict[str, int | None] = {}
        """KV pages per tier of the first engine: no restarted one may have fewer."""
        self._num_restarts = 0
        self._index_dropped = 0
        """Disk-cache index entries dropped at the starts so far."""

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
        try:
            self._fix_capacity()
        except UserError as e:
            assert self._executor is not None
            await asyncio.to_thread(self._executor.shutdown)
            raise EngineStartError(str(e)) from e
        self._core = self._new_core()
        self._emit(self._core, 0.0, batch_size=0)  # every series from the start
        self._thread = threading.Thread(target=self._run, name="nanoflex-core", daemon=True)
        self._thread.start()
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
        self._max_model_len = args.context_len(self.model_dir)
        self._max_token_bytes = longest_token_bytes(self.model_dir)
        self._generation_defaults = generation_defaults(self.model_dir)
        self._pooling = pooling_spec(self.model_dir)
        self._vision = VisionSpec.from_model_dir(self.model_dir)
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

    async def shutdown(self) -> None:
        self._stopping.set()
        if self._loading.is_set() and self._executor is not None:
            self._executor.abort_start()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
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

    def _storage_blocked(self) -> bool:
        """No KV tier that holds a longest sequence may be used now (its storage failed a
        moment ago): read from any thread, a snapshot."""
        core = self._core
        return core is not None and core.scheduler.is_blocked_by_storage()

    def status(self) -> str:
        core = self._core
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

    def _fix_capacity(self) -> None:
        """After the first start: refuse KV pools too small for one sequence of the context
        length, and keep this engine's budgets for every restart."""
        assert self._executor is not None and self.policy is not None
        info = self._executor.describe()
        self._took(info)
        tokens = largest_pool_tokens(info.kv_capacity_pages, self.policy.kv_frac, info.page_tokens)
        if tokens < self._max_model_len:
            budgets = ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in info.budgets.items())
            raise UserError(
                f"the KV cache can hold only {tokens} tokens per sequence under the policy's "
                f"kv_frac {list(self.policy.kv_frac)} and the budgets ({budgets}), fewer than "
                f"the context length {self._max_model_len}: give the KV tier more room "
                "(--disk-mem, --cpu-mem, free space under --offload-dir) or lower --max-model-len"
            )
        self._capacity = dict(info.kv_capacity_pages)
        if info.budgets:  # never derived again: a restart gets what the daemon announced
            b = info.budgets
            fixed = dataclasses.replace(
                self.engine_args, gpu_mem=b["gpu"], cpu_mem=b["cpu"], disk_mem=b["disk"]
            )
            self._executor.kwargs["args"] = fixed

    def _check_restarted(self) -> None:
        """A restarted engine must have the capacity the first one announced."""
        assert self._executor is not None
        info = self._executor.describe()
        self._took(info)
        now = info.kv_capacity_pages
        smaller = [
            t
            for t, first in self._capacity.items()
            if (first is None and now.get(t) is not None) or (now.get(t) or 0) < (first or 0)
        ]
        if smaller:
            raise RuntimeError(
                f"the restarted engine has less KV capacity ({now}) than at start "
                f"({self._capacity})"
            )

    def _took(self, info: EngineInfo) -> None:
        """Log what a freshly built engine reports: its warnings and its warm-up's time."""
        for line in info.warnings:
            log.warning("%s", line)
        self._index_dropped += info.disk_cache_dropped
        if info.warm_up is not None:
            w = info.warm_up
            log.info(
                "engine: warm-up %.1f s (%d CUDA graphs captured, %d Triton specializations "
                "compiled)",
                w.seconds,
                w.graphs_captured,
                w.kernels_compiled,
            )

    def _new_core(self) -> EngineCore:
        assert self.policy is not None and self.model_dir is not None and self._executor
        scheduler = self.engine_args.create_scheduler(
            self.policy, self.model_dir, self._executor.describe(), self._tokenizer
        )
        self._counter = _StepCounter(self._executor)
        on_cpu_here = self._in_process and self._executor.describe().placement.device == "cpu"
        return EngineCore(scheduler, self._counter, self.engine_args.plans_ahead(on_cpu_here))

    def _close_core(self) -> None:
        """Close the engine core (after a crash, or at the end), keeping its counts."""
        core, self._core = self._core, None
        if core is not None:
            self._preemptions_before += core.scheduler.num_preemptions
            with contextlib.suppress(Exception):  # the failed step's error: already handled
                core.close()

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
        return self._max_model_len

    @property
    def vision(self) -> VisionSpec | None:
        self._loaded()
        return self._vision

    @property
    def vocab_size(self) -> int:
        return self._loaded().vocab_size

    @property
    def max_token_bytes(self) -> int:
        self._loaded()
        return self._max_token_bytes

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
        return self._generation_defaults

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
        deltas = _Stream(asyncio.get_running_loop())
        for child_id in child_ids:
            self._streams[child_id] = deltas
        self._children[request_id] = child_ids
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
            for child_id in child_ids:
                self._streams.pop(child_id, None)
            self._children.pop(request_id, None)
            if unfinished:
                self._commands.put(("abort", sorted(unfinished)))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", self._children.get(request_id, [request_id])))

    # -- pooling (a decoder embedder or reranker: engine/runtime/pooled_requests.py) ---------

    @property
    def pooling_spec(self) -> PoolingSpec | None:
        self._loaded()
        return self._pooling

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

    # -- the worker thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            core = self._core
            assert core is not None
            # idle, or every request waits for a tier resting after a storage fault
            self._drain_commands(core, block=not core.has_unfinished() or core.is_stalled)
            if not core.has_unfinished():
                if self._reported_busy:  # drained by aborts, not by a step: zero the gauges
                    self._emit(core, 0.0, batch_size=0)
                continue
            start = time.perf_counter()
            try:
                deltas = core.step()
            except ExecutorDiedError as e:
                if not self._recover(e):
                    break
                continue
            except Exception as e:  # an engine bug: its state may no longer match the plan
                log.exception("engine step failed")
                assert self._executor is not None
                self._executor.kill()
                if not self._recover(e):
                    break
                continue
            assert self._counter is not None
            ran = 0 if core.is_stalled else self._counter.num_seqs  # stalled: nothing ran
            self._emit(core, time.perf_counter() - start, ran)
            if deltas:
                self._call_soon(self._dispatch, deltas)
        self._close_core()

    def _drain_commands(self, core: EngineCore, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            kind, payload = command
            if kind == "add":
                children, reply = payload
                error: Exception | None = None
                added: list[str] = []
                try:
                    for child in children:
                        core.add_request(child)
                        added.append(child.request_id)
                except ValueError as e:  # PromptTooLongError, RequestError: the caller's 400
                    error = e
                    for child_id in added:  # the choices run together or not at all
                        core.abort(child_id)
                self._call_soon(_resolve, reply, error)
            elif kind == "abort":
                for child_id in payload:
                    core.abort(child_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _recover(self, error: Exception) -> bool:
        """The engine process died: fail what was in flight, restart it after a back-off and
        start over clean. False: stopping, or the restart limit is reached (fatal)."""
        log.error("engine process died (%s)", _one_line(error))
        self._ready.clear()
        self._call_soon(self._fail_all, EngineDeadError("the engine process died; retry"))
        assert self._executor is not None
        while not self._stopping.is_set():
            delay = self._restarts.next_delay(time.monotonic())
            if delay is None:
                policy = self._restarts.policy
                message = (
                    f"the engine crashed {policy.max_restarts + 1} times within "
                    f"{policy.window_s:.0f} s; giving up (last: {_one_line(error)})"
                )
                self._set_status(message)
                self._close_core()
                self.emit_fatal(message)
                return False
            self._set_status(
                f"restarting the engine in {delay:.0f} s after a crash (restart "
                f"{self._restarts.num_recent} of at most {self._restarts.policy.max_restarts})"
            )
            if self._stopping.wait(delay):
                return False
            try:
                self._executor.restart()
                self._num_restarts += 1
                self._check_restarted()
                break
            except Exception as e:
                log.error("engine restart failed: %s", _one_line(e))
                error = e
        self._close_core()
        if self._stopping.is_set():
            return False
        self._core = self._new_core()
        self._emit(self._core, 0.0, batch_size=0)
        self._set_status("ready")
        self._ready.set()
        return True

    def _emit(self, core: EngineCore, step_seconds: float, batch_size: int) -> None:
        scheduler = core.scheduler
        pages = scheduler.page_manager
        assert self._executor is not None
        info = self._executor.describe()
        self._reported_busy = scheduler.has_unfinished()
        self.emit_step(
            StepStats(
                step_seconds=step_seconds,
                batch_size=batch_size,
                num_waiting=scheduler.num_waiting,
                num_running=len(scheduler.running),
                queues=scheduler.queue_lengths(),
                bytes_per_tier=self._counter.bytes_per_tier if self._counter else {},
                num_preemptions=self._preemptions_before + scheduler.num_preemptions,
                prefix_cache=copy.deepcopy(pages.stats),
                cached_pages={tier: pages.num_cached_pages(tier) for tier in TIERS},
                page_bytes=info.page_bytes,
                used_pages={tier: pages.num_used_pages(tier) for tier in TIERS},
                capacity_pages=dict(pages.capacity_pages),
                offload_faults=scheduler.rest.num_faults,
                index_dropped=self._index_dropped,
                num_restarts=self._num_restarts,
            )
        )

    def _dispatch(self, deltas: list[SequenceDelta]) -> None:
        """On the event loop: one step's deltas to their requests' streams. A request that
        does not stream is final-only in the engine: it hears once per choice, with all of
        it (no task wakes per token)."""
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.retryable:  # the engine's storage failed it: not the request's answer
                stream.put(StorageUnavailableError(delta.error or "storage failed"))
                continue
            stream.put(delta)

    def _fail_all(self, error: Exception) -> None:
        """On the event loop: end every request in flight with `error`."""
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.put(error)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)


class _Stream:
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


class _StepCounter:
    """The executor, remembering what the last step ran and left: the batch size (the
    scheduler's running list no longer holds the ones that finished in the step) and the
    bytes resident per tier (the pools grow as they fill: /metrics follows them)."""

    def __init__(self, executor: ExecutorClient) -> None:
        self.executor = executor
        self.num_seqs = 0
        self.bytes_per_tier = executor.describe().placement.bytes_per_tier()

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_seqs = len({chunk.seq_id for chunk in plan.chunks})
        result = self.executor.execute(plan)
        if result.bytes_per_tier:
            self.bytes_per_tier = result.bytes_per_tier
        return result


def longest_token_bytes(model_dir: Path) -> int:
    """The longest vocabulary entry (added tokens included) in UTF-8 bytes, as spelled in
    tokenizer.json. A spelling is never shorter than the text it decodes to (byte-level
    BPE spells a byte as one character, SentencePiece a space as '▁', a fallback byte as
    '<0x41>'), so this bounds the bytes of text per token from above."""
    vocab = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab(True)
    return max((len(piece.encode()) for piece in vocab), default=1)


def _resolve(future: asyncio.Future[Exception | None], error: Exception | None) -> None:
    if not future.done():
        future.set_result(error)


def _one_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def build_engine_client(args: argparse.Namespace) -> EngineClient:
    """`nanoflex serve`'s engine, not started: nothing is loaded until `start()`. A local
    directory of a pooling model gets the pooling engine (engine/runtime/pooling_client.py)."""
    pooling = pooling_client_for(args)
    if pooling is not None:
        return pooling
    engine_args = EngineArgs.from_cli_args(args)
    name = getattr(args, "served_model_name", None) or served_model_name(engine_args.model)
    return CoreEngineClient(
        engine_args, model_name=name, in_process=getattr(args, "in_process", False)
    )
