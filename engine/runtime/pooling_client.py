"""`PoolingEngineClient`: the daemon's engine for an encoder pooling model (a BERT-style
embedder or cross-encoder, engine/core/pooling.py): no scheduler and no KV cache, a
request's inputs run as one call of `PoolingRunner` (engine/pooling_runner.py) in a child
process (or, with `in_process`, in this one), one call at a time. Decoder pooling models
(Qwen3-Embedding, Qwen3-Reranker) are served by the generation engine instead
(engine/runtime/pooled_requests.py), with its planner, tiers and batching.

`generate` is refused: the daemon answers generation routes on a pooling model with a 400
before it gets here (server/openai/embeddings.py).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
from collections.abc import AsyncGenerator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from engine.core.engine_args import EngineArgs
from engine.core.media import SeqMedia
from engine.core.model_files import looks_local, served_model_name
from engine.core.outputs import SequenceDelta
from engine.core.pooling import PoolingSpec, pooling_spec
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY
from engine.core.tokenizer import ChatOptions, Tokenizer
from engine.runtime.engine_client import EngineClient, EngineDeadError
from engine.runtime.executor_client import build_from_path, start_error_line

POOLING_FACTORY = "engine.pooling_runner:load_runner"


class PoolingError(RuntimeError):
    """The pooling forward failed (the message says why)."""


def _child_main(conn: Connection, kwargs: dict[str, Any]) -> None:
    """The child: load the runner, then answer (op, payload) messages until None."""
    try:
        runner = build_from_path(POOLING_FACTORY, kwargs)
    except Exception as e:  # the parent reports it and stops
        conn.send(("error", start_error_line(e)))
        return
    conn.send(("ok", None))
    while (message := _receive(conn)) is not None:
        op, payload = message
        try:
            conn.send(("ok", getattr(runner, op)(payload)))
        except Exception as e:  # one failed call, the model stays up
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _receive(conn: Connection) -> Any:
    try:
        return conn.recv()
    except EOFError:
        return None


class PoolingEngineClient(EngineClient):
    """A pooling model served: its tokenizer here, its forward in `_call`."""

    def __init__(
        self,
        model_dir: Path,
        spec: PoolingSpec,
        model_name: str,
        device: str = "auto",
        dtype: str | None = None,
        in_process: bool = False,
        packed: bool = True,
    ) -> None:
        super().__init__()
        self.model_dir, self.spec, self._model_name = model_dir, spec, model_name
        self._kwargs = {
            "model_dir": str(model_dir),
            "device": device,
            "dtype": dtype,
            "packed": packed,
        }
        self._in_process = in_process
        self._tokenizer = Tokenizer(model_dir)
        self._lock = asyncio.Lock()
        self._runner: Any = None
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False

    async def start(self) -> None:
        if self._in_process:
            self._runner = await asyncio.to_thread(build_from_path, POOLING_FACTORY, self._kwargs)
        else:
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._process = ctx.Process(
                target=_child_main, args=(child, self._kwargs), name="nanoflex-pooling", daemon=True
            )
            self._process.start()
            child.close()
            status, detail = await asyncio.to_thread(self._conn.recv)
            if status != "ok":
                raise PoolingError(f"the pooling model did not load: {detail}")
        self._ready = True

    async def shutdown(self) -> None:
        self._ready = False
        if self._conn is not None:
            self._conn.send(None)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        self._runner = self._process = self._conn = None

    def is_ready(self) -> bool:
        return self._ready and (self._process is None or self._process.is_alive())

    async def _call(self, op: str, payload: Any) -> Any:
        """One runner call (`embed` or `score`), after those before it."""
        self.check_ready()
        async with self._lock:
            if self._runner is not None:
                return await asyncio.to_thread(getattr(self._runner, op), payload)
            assert self._conn is not None
            try:
                self._conn.send((op, payload))
                status, value = await asyncio.to_thread(self._conn.recv)
            except (EOFError, OSError) as e:
                self._ready = False
                raise EngineDeadError("the pooling process died") from e
        if status != "ok":
            raise PoolingError(value)
        return value

    @property
    def pooling_spec(self) -> PoolingSpec:
        return self.spec

    async def embed(
        self, inputs: list[list[int]], priority: int = ONLINE_PRIORITY
    ) -> list[list[float]]:
        """One vector per input's token ids, pooled and normalized as the model declares (in
        arrival order: `priority` does not apply)."""
        return list(await self._call("embed", inputs))

    async def score(
        self, pairs: list[tuple[list[int], list[int]]], priority: int = ONLINE_PRIORITY
    ) -> list[float]:
        """A cross-encoder's score per (token ids, token type ids) pair."""
        return list(await self._call("score", pairs))

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self.spec.max_length

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def max_token_bytes(self) -> int:
        return 64

    @property
    def eos_token_id(self) -> int | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens)

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        return self._tokenizer.encode_pair(first, second)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        return self._tokenizer.apply_chat_template(messages, options)

    def tokenizer_info(self) -> dict[str, Any]:
        return {**self._tokenizer.info(), "model_max_length": self.max_model_len}

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
        raise PoolingError(f"{self._model_name} is a pooling model: it does not generate")
        yield  # an async generator, as the interface asks

    async def abort(self, request_id: str) -> None:
        return None


def pooling_client_for(args: argparse.Namespace) -> PoolingEngineClient | None:
    """`nanoflex serve`'s engine when MODEL is a local directory of a pooling model (None
    otherwise: the generation engine serves it)."""
    model = getattr(args, "model", None)
    if not model or not looks_local(model) or not Path(model).is_dir():
        return None
    spec = pooling_spec(Path(model))
    if spec is None or not spec.is_encoder:  # decoders: the generation engine pools them
        return None
    engine_args = EngineArgs.from_cli_args(args)
    name = getattr(args, "served_model_name", None) or served_model_name(model)
    return PoolingEngineClient(
        Path(model),
        spec,
        name,
        device=engine_args.device,
        dtype=engine_args.dtype,
        in_process=getattr(args, "in_process", False),
        packed=engine_args.packed_pooling,
    )
