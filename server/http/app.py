"""`create_app`: the OpenAI-compatible FastAPI app over one `EngineClient` (no torch here).

Online completions and chat run at priority 0, Batch API work at priority 1.
A client that disconnects has its engine requests aborted.

The engine starts in the background once the app serves: /health answers at once
(liveness), /ready answers 503 with what the engine is doing until it is loaded, and a
request that arrives meanwhile waits for it (`--ready-wait`, then 503 with Retry-After).
An engine that cannot start, or that crashes past its restart limit, calls `on_fatal` with
one line (`nanoflex serve` then exits non-zero); /ready shows that line, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive

from base.errors import UserError
from engine.core.sequence import ONLINE_PRIORITY
from engine.runtime.engine_client import EngineClient, EngineDeadError
from server.batch.data_dir import open_data_dir
from server.batch.runner import BatchRunner
from server.http.batch_routes import router as batch_router
from server.http.errors import CLIENT_CLOSED_REQUEST, install_error_handlers
from server.http.middleware import Guard
from server.http.openapi import install_openapi
from server.http.request_body import decode_json, read_body
from server.http.responses import json_response
from server.http.settings import ServerSettings
from server.http.state import AppState, get_state
from server.openai.embeddings import EMBEDDINGS, RERANK, SCORE
from server.openai.endpoints.base import Endpoint
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import not_found
from server.openai.metrics import CONTENT_TYPE, Metrics
from server.openai.responses import Health, Model, ModelList, NotReady, Ready, now
from server.openai.serving import CHAT, COMPLETIONS, RESPONSES, Serving

logger = logging.getLogger("nanoflex.server")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
    return task.result()


def create_app(
    settings: ServerSettings,
    engine: EngineClient,
    *,
    start_engine: bool = True,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """The daemon's app. Its lifespan starts the engine in the background (unless
    `start_engine` is False: the caller started it), resumes unfinished batches, and shuts
    both down at exit. `on_fatal(line)` is called (from any thread) when the engine cannot
    start or is gone for good."""
    store, storage = open_data_dir(settings.data_dir)
    metrics = Metrics(engine)
    model_name = settings.served_model_name or engine.model_name
    serving = Serving(
        engine,
        model_name,
        metrics,
        settings.max_seqs_per_request,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        media_limits=settings.media_limits,
    )
    state = AppState(
        settings=settings,
        engine=engine,
        store=store,
        storage=storage,
        metrics=metrics,
        serving=serving,
        runner=BatchRunner(store, storage, serving, settings.batch_config()),
    )

    def fatal(message: str) -> None:
        state.engine_error = message
        if on_fatal is None:
            logger.error("the engine cannot run: %s", message)
        else:  # the caller reports it
            on_fatal(message)

    engine.add_fatal_listener(fatal)

    async def start() -> None:
        try:
            await engine.start()
        except UserError as e:  # the client's one line: bad model, no device, out of memory
            fatal(str(e))
        except Exception as e:  # a bug: keep its traceback in the log
            logger.exception("engine failed to start")
            fatal(f"{type(e).__name__}: {e}".splitlines()[0])
        else:
            logger.info("engine ready: serving %s", model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start()) if start_engine else None
        await state.runner.start()
        try:
            yield
        finally:
            await state.runner.stop()
            if starting is not None:
                await engine.shutdown()  # aborts a load still under way
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            store.close()
            logger.info("nanoflex stopped: batch work paused, engine shut down, store closed")

    app = FastAPI(title="nanoflex", lifespan=lifespan)
    app.state.nanoflex = state
    install_error_handlers(app)
    app.add_middleware(
        Guard,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        max_file_bytes=settings.max_file_bytes,
        body_timeout_s=settings.body_timeout_s,
        body_total_timeout_s=settings.body_total_timeout_s,
        bind_host=settings.bind_host,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
    )
    if settings.allowed_origins:  # outside the Guard: a CORS preflight carries no API key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.include_router(batch_router)
    _add_online_routes(app)
    install_openapi(app, secured=settings.api_key is not None)
    return app


def _prepare(endpoint: Endpoint, raw: bytes) -> Prepared:
    """Decode, validate and tokenize a request body (in a worker thread: a long prompt
    takes a while to tokenize and must not stall the event loop)."""
    return endpoint.prepare(decode_json(raw))


async def _generate(request: Request, path: str) -> Response:
    state = get_state(request)
    raw = await read_body(request)
    await state.wait_ready()
    endpoint = state.serving.endpoint(path)
    prep = await asyncio.to_thread(_prepare, endpoint, raw)
    state.serving.check_ready()
    state.admit(prep.num_seqs)
    if not prep.stream:
        try:
            result = await _unless_disconnected(request, endpoint.run(prep, ONLINE_PRIORITY))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            state.release(prep.num_seqs)
        return json_response(result)
    chunks = endpoint.stream(prep, ONLINE_PRIORITY)
    try:
        first = await _unless_disconnected(request, anext(chunks))
    except BaseException as e:
        state.release(prep.num_seqs)
        await chunks.aclose()
        if isinstance(e, ClientDisconnected):  # gone before its first chunk: nothing to log
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise

    async def sse_body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            state.release(prep.num_seqs)

    return StreamingResponse(sse_body(), media_type="text/event-stream")


POOLING_ROUTES = {
    EMBEDDINGS: EMBEDDINGS,
    SCORE: SCORE,
    "/score": SCORE,
    RERANK: RERANK,
    "/rerank": RERANK,
    "/v2/rerank": RERANK,
}
"""Pooling paths (vLLM serves score and rerank with and without /v1) -> their endpoint."""


def _add_pooling_route(app: FastAPI, path: str, endpoint: str) -> None:
    async def pooling(request: Request) -> Response:
        return await _generate(request, endpoint)

    app.post(path, name=f"pooling {path}")(pooling)


def _add_online_routes(app: FastAPI) -> None:
    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, CHAT)

    @app.post(RESPONSES)
    async def responses(request: Request) -> Response:
        return await _generate(request, RESPONSES)

    for path, endpoint in POOLING_ROUTES.items():
        _add_pooling_route(app, path, endpoint)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        state, body = get_state(request), decode_json(await read_body(request))
        await state.wait_ready()
        return json_response(await asyncio.to_thread(state.serving.tokenization.tokenize, body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        state, body = get_state(request), decode_json(await read_body(request))
        await state.wait_ready()
        return json_response(await asyncio.to_thread(state.serving.tokenization.detokenize, body))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        state = get_state(request)
        await state.wait_ready()
        return json_response(state.serving.tokenization.tokenizer_info())

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return json_response(ModelList(object="list", data=[_model(get_state(request))]))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> Response:
        state = get_state(request)
        if model_id != state.serving.model_name:
            raise not_found("model", model_id)
        return json_response(_model(state))

    @app.get("/health")
    async def health() -> Response:
        return json_response(Health(status="ok"))

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        state = get_state(request)
        if state.engine.is_ready():
            return json_response(Ready(status="ready", model=state.serving.model_name))
        if state.engine_error is not None:
            not_ready = NotReady(status="failed", detail=state.engine_error)
        else:
            not_ready = NotReady(status="not_ready", detail=state.engine.status())
        return json_response(not_ready, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model(state: AppState) -> Model:
    """The served model; `max_model_len` once the model is loaded (vLLM's extension)."""
    model = Model(id=state.serving.model_name, object="model", created=now(), owned_by="nanoflex")
    with contextlib.suppress(EngineDeadError):  # still loading: no length yet
        model.max_model_len = state.engine.max_model_len
    return model
