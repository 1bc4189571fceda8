"""`CoreEngineClient`: the daemon's engine: the scheduler here, the executor in its own process.

One worker thread owns the `Scheduler` and `EngineCore` (neither is thread-safe)
and steps them; the asyncio side talks to it only through a command queue and
gets outputs back with `call_soon_threadsafe`. If the engine process dies, the
client reports not-ready, restarts it with a fresh scheduler and fails the
requests that were in flight with `EngineDeadError` (batch work is retried by
the batch runner, so batch jobs lose nothing; online callers see a 503).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.core.engine_args import EngineArgs
from engine.core.engine_core import EngineCore
from engine.core.model_files import context_length, resolve_model_dir, served_model_name
from engine.core.outputs import RequestOutput
from engine.core.protocol import StepPlan, StepResult
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY, Request
from engine.core.tokenizer import Tokenizer
from policy import Policy
from server.engine_client import EngineClient, EngineDeadError, StepStats
from server.engine_process import ExecutorDiedError, ExecutorProcess, InProcessExecutor

log = logging.getLogger("nanoflex.engine")

EXECUTOR_FACTORY = "engine.executor.executor:build_executor"
_IDLE_WAIT_S = 0.05


class CoreEngineClient(EngineClient):
    def __init__(
        self,
        engine_args: EngineArgs,
        model_dir: Path,
        policy: Policy,
        *,
        model_name: str,
        in_process: bool = False,
    ) -> None:
        super().__init__()
        self.engine_args, self.model_dir, self.policy = engine_args, model_dir, policy
        self._model_name = model_name
        self._tokenizer = Tokenizer(model_dir)
        kwargs = engine_args.executor_kwargs(model_dir, policy)
        self._executor: ExecutorProcess | InProcessExecutor = (
            InProcessExecutor(EXECUTOR_FACTORY, kwargs)
            if in_process
            else ExecutorProcess(EXECUTOR_FACTORY, kwargs)
        )
        self._max_model_len = context_length(model_dir)
        self._max_token_bytes = longest_token_bytes(model_dir)
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._core: EngineCore | None = None
        self._preemptions_before = 0
        self._counter = _StepCounter(self._executor)
        self._reported_busy = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._executor.start)
        self._core = self._new_core()
        self._thread = threading.Thread(target=self._run, name="nanoflex-core", daemon=True)
        self._thread.start()
        self._ready.set()

    async def shutdown(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self._executor.shutdown)
        self._ready.clear()

    def is_ready(self) -> bool:
        return self._ready.is_set() and self._executor.is_alive

    def _new_core(self) -> EngineCore:
        if self._core is not None:  # a restart: keep counting across schedulers
            self._preemptions_before += self._core.scheduler.num_preemptions
        scheduler = self.engine_args.create_scheduler(
            self.policy, self.model_dir, self._executor.describe(), self._tokenizer
        )
        self._counter = _StepCounter(self._executor)
        return EngineCore(scheduler, self._counter, self.engine_args.async_scheduling)

    # -- model and tokenizer ---------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def max_token_bytes(self) -> int:
        return self._max_token_bytes

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self._tokenizer.apply_chat_template(messages)

    # -- generation ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = ONLINE_PRIORITY,
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_ready():
            raise EngineDeadError("the engine is not ready")
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream
        reply: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        request = Request(request_id, list(prompt_token_ids), params, priority)
        self._commands.put(("add", (request, reply)))
        finished = False
        try:
            error = await reply  # the scheduler's verdict on the request (e.g. too long)
            if error is not None:
                raise error
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- the worker thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            core = self._core
            assert core is not None
            self._drain_commands(core, block=not core.has_unfinished())
            if not core.has_unfinished():
                if self._reported_busy:  # drained by aborts, not by a step: zero the gauges
                    self._emit(core, 0.0, batch_size=0)
                continue
            start = time.perf_counter()
            try:
                outputs = core.step()
            except ExecutorDiedError as e:
                self._recover(e)
                continue
            except Exception as e:  # an engine bug: its state may no longer match the plan
                log.exception("engine step failed")
                self._executor.kill()
                self._recover(e)
                continue
            self._emit(core, time.perf_counter() - start, self._counter.num_seqs)
            for out in outputs:
                self._deliver(out.request_id, out)
        if self._core is not None:
            self._core.close()

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
                request, reply = payload
                error: Exception | None = None
                try:
                    core.add_request(request)
                except ValueError as e:  # PromptTooLongError, RequestError: the caller's 400
                    error = e
                self._call_soon(_resolve, reply, error)
            elif kind == "abort":
                core.abort(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _recover(self, error: Exception) -> None:
        """The engine process died: fail what was in flight, restart it, start over clean."""
        log.error("engine process died (%s); restarting it", error)
        self._ready.clear()
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError("the engine process died; retry"))
        while not self._stopping.is_set():
            try:
                self._executor.restart()
                break
            except Exception:
                log.exception("engine restart failed; retrying in 5 s")
                time.sleep(5.0)
        self._core = self._new_core()
        self._emit(self._core, 0.0, batch_size=0)
        self._ready.set()

    def _emit(self, core: EngineCore, step_seconds: float, batch_size: int) -> None:
        scheduler = core.scheduler
        self._reported_busy = scheduler.has_unfinished()
        self.emit_step(
            StepStats(
                step_seconds=step_seconds,
                batch_size=batch_size,
                num_waiting=scheduler.num_waiting,
                num_running=len(scheduler.running),
                bytes_per_tier=self._executor.describe().placement.bytes_per_tier(),
                num_preemptions=self._preemptions_before + scheduler.num_preemptions,
            )
        )

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._call_soon(stream.put_nowait, item)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)


class _StepCounter:
    """The executor, remembering how many sequences the last step ran (the batch size:
    the scheduler's running list no longer holds the ones that finished in the step)."""

    def __init__(self, executor: ExecutorProcess | InProcessExecutor) -> None:
        self.executor = executor
        self.num_seqs = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_seqs = len({chunk.seq_id for chunk in plan.chunks})
        return self.executor.execute(plan)


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


def build_engine_client(args: argparse.Namespace) -> CoreEngineClient:
    """`nanoflex serve`'s engine: the model resolved here, loaded in the engine process."""
    return engine_client(
        EngineArgs.from_cli_args(args), in_process=getattr(args, "in_process", False)
    )


def engine_client(engine_args: EngineArgs, *, in_process: bool = False) -> CoreEngineClient:
    """An (unstarted) client for `engine_args`: the model resolved and the policy chosen
    here, on this machine; the executor in this process or in an engine process."""
    model_dir = resolve_model_dir(engine_args.model)
    policy, plan = engine_args.resolve_policy(model_dir)
    log.info("policy %s%s", policy.to_json(), f" planned: {plan}" if plan else "")
    return CoreEngineClient(
        engine_args,
        model_dir,
        policy,
        model_name=served_model_name(engine_args.model),
        in_process=in_process,
    )
