"""`ToyEngineClient`: a tiny, deterministic, torch-free stand-in for the engine (TESTS ONLY).

Not a model. Tokens are UTF-8 bytes shifted by 3 (0 pad, 1 BOS, 2 EOS); the
"model" writes lowercase letters: greedy token k of a request is
chr(ord('a') + (len(prompt) + k) % 26); with temperature > 0 a `random.Random`
seeded from `seed` picks letters. A background loop "steps" every `step_s`
seconds, running at most `max_running` requests, lowest priority first, FIFO
within a priority, and reports `StepStats` like the real engine. `kill()` and
`revive()` simulate an engine process crash and restart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol import TokenLogprobs
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient, EngineDeadError, StepStats

TOKEN_OFFSET = 3
BOS, EOS = 1, 2
VOCAB_SIZE = 256 + TOKEN_OFFSET


@dataclass
class _ToyRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    queue: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    rng: random.Random | None = None


class ToyEngineClient(EngineClient):
    """The `EngineClient` contract, implemented with letters instead of a model."""

    def __init__(
        self, step_s: float = 0.001, max_running: int = 8, max_model_len: int = 256
    ) -> None:
        super().__init__()
        self.step_s = step_s
        self.max_running = max_running
        self._max_model_len = max_model_len
        self._waiting: list[_ToyRequest] = []
        self._running: dict[str, _ToyRequest] = {}
        self._arrivals = 0
        self._ready = False
        self._loop_task: asyncio.Task[None] | None = None
        self.aborted: list[str] = []
        self.started: list[tuple[str, int, int]] = []
        """(request_id, priority, arrival number) in the order requests began running."""

    # lifecycle
    async def start(self) -> None:
        self._ready = True
        self._loop_task = asyncio.create_task(self._step_loop())

    async def shutdown(self) -> None:
        self._ready = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    def is_ready(self) -> bool:
        return self._ready

    def kill(self) -> None:
        """Simulate an engine crash: every unfinished request fails with EngineDeadError."""
        self._ready = False
        for req in [*self._waiting, *self._running.values()]:
            req.queue.put_nowait(EngineDeadError("toy engine killed"))
        self._waiting.clear()
        self._running.clear()

    def revive(self) -> None:
        self._ready = True

    # model and tokenizer
    @property
    def model_name(self) -> str:
        return "toy-model"

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def eos_token_id(self) -> int:
        return EOS

    def encode(self, text: str) -> list[int]:
        return [BOS] + [b + TOKEN_OFFSET for b in text.encode()]

    def decode(self, token_ids: Sequence[int]) -> str:
        data = bytes(t - TOKEN_OFFSET for t in token_ids if t >= TOKEN_OFFSET)
        return data.decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
        return self.encode(text)

    # generation
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if not self._ready:
            raise EngineDeadError("toy engine is not running")
        self._arrivals += 1
        req = _ToyRequest(request_id, list(prompt_token_ids), params, priority, self._arrivals)
        if params.temperature > 0:
            req.rng = random.Random(params.seed)
        self._waiting.append(req)
        while True:
            item = await req.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._waiting = [r for r in self._waiting if r.request_id != request_id]
        self._running.pop(request_id, None)

    async def _step_loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            if not self._ready:
                continue
            self._waiting.sort(key=lambda r: (r.priority, r.arrival))
            while self._waiting and len(self._running) < self.max_running:
                req = self._waiting.pop(0)
                self._running[req.request_id] = req
                self.started.append((req.request_id, req.priority, req.arrival))
            batch = list(self._running.values())
            for req in batch:
                self._advance(req)
            self.emit_step(
                StepStats(
                    step_seconds=self.step_s,
                    batch_size=len(batch),
                    num_waiting=len(self._waiting),
                    num_running=len(self._running),
                    bytes_per_tier={"gpu": 1024 * len(self._running), "cpu": 0, "disk": 0},
                )
            )

    def _advance(self, req: _ToyRequest) -> None:
        k = len(req.token_ids)
        if req.rng is not None:
            letter = req.rng.randrange(26)
        else:
            letter = (len(req.prompt) + k) % 26
        token = ord("a") + letter + TOKEN_OFFSET
        req.token_ids.append(token)
        req.logprobs.append(TokenLogprobs(token, -0.5, [(token, -0.5), (token + 1, -1.5)]))
        text, finish = self.decode(req.token_ids), None
        for stop in req.params.stop:
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
        if finish is None and token in req.params.stop_token_ids:
            finish = "stop"
        if finish is None and len(req.token_ids) >= req.params.max_tokens:
            finish = "length"
        logprobs = list(req.logprobs) if req.params.logprobs is not None else None
        output = CompletionOutput(0, text, list(req.token_ids), finish, logprobs)
        req.queue.put_nowait(
            RequestOutput(req.request_id, req.prompt, [output], finish is not None)
        )
        if finish is not None:
            self._running.pop(req.request_id, None)


def build_toy_engine(args: argparse.Namespace) -> ToyEngineClient:
    """Factory for `NANOFLEX_ENGINE_CLIENT=toy_engine:build_toy_engine nanoflex serve`."""
    return ToyEngineClient(step_s=float(os.environ.get("NANOFLEX_TOY_STEP_S", "0.001")))
