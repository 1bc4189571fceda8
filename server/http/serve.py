"""`nanoflex serve`: build the engine client and the app, run uvicorn, shut down gracefully.

The engine client comes from a factory `module:function(args) -> EngineClient`,
by default `engine.runtime.step_loop_client:build_engine_client`; the environment variable
NANOFLEX_ENGINE_CLIENT names another (a different backend or a test double).
uvicorn turns SIGTERM/SIGINT into a graceful shutdown:
stop accepting, finish in-flight responses, stop batch work (pending requests
stay in the store), shut the engine down, close the store.

Start-up order: the port is bound first (a port already in use ends the command at once),
then the `--offload-dir` is locked (one daemon per directory: engine/core/offload_dir.py;
the engine process holds the lock with it), then the data directory is checked, then
uvicorn serves while the engine loads in the
background (/health 200, /ready 503 with the loading step). Anything that cannot work
(a port in use, an offload directory another daemon uses, a damaged data directory, a
model that cannot load, no device, out of memory, an engine that keeps crashing) ends the
command with one `nanoflex serve: error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.core.offload_dir import lock_offload_dir
from engine.runtime.engine_client import EngineClient
from server.batch.data_dir import check_data_dir
from server.http.app import create_app
from server.http.connection import DaemonConfig
from server.http.settings import API_KEY_ENV, ServerSettings
from server.openai.media import add_media_arguments
from server.openai.memory import keep_heaps_trimmed
from server.openai.parsers.reasoning import PARSERS as REASONING_PARSERS
from server.openai.parsers.tool_calls import PARSERS as TOOL_PARSERS

DEFAULT_ENGINE_CLIENT = "engine.runtime.step_loop_client:build_engine_client"
ENGINE_CLIENT_ENV = "NANOFLEX_ENGINE_CLIENT"
GRACEFUL_SHUTDOWN_S = 30


def load_factory(spec: str) -> Callable[..., object]:
    """The callable named by 'package.module:function'."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"engine client factory {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"cannot import {module_name!r} for the engine client: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{spec!r} does not name a function in {module_name!r}")
    return factory


def build_engine_client(args: argparse.Namespace) -> EngineClient:
    spec = os.environ.get(ENGINE_CLIENT_ENV, DEFAULT_ENGINE_CLIENT)
    client = load_factory(spec)(args)
    if not isinstance(client, EngineClient):
        raise UserError(f"{spec!r} returned {type(client).__name__}, not an EngineClient")
    return client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and GET /v1/models lists (default: MODEL as given, "
        "or smollm2-135m-instruct without one)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--data-dir",
        default="nanoflex-data",
        help="SQLite store, files, results (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require this bearer token (visible in ps: prefer ${API_KEY_ENV} or --api-key-file)"
        f" (default: ${API_KEY_ENV}, else no key)",
    )
    parser.add_argument(
        "--api-key-file", default=None, help="read the bearer token from FILE (default: none)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="online sequences (prompts x n of every admitted request) in flight before 429 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--ready-wait",
        type=float,
        default=ServerSettings.ready_wait_s,
        metavar="SECONDS",
        help="a request that arrives while the model loads or the engine restarts waits this "
        "long for it, then gets 503 with Retry-After (0: at once) (default: %(default)s)",
    )
    parser.add_argument(
        "--max-uploads",
        type=int,
        default=ServerSettings.max_uploads,
        metavar="N",
        help="uploads to POST /v1/files received at once; one more is answered 429 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-batches",
        type=int,
        default=ServerSettings.max_batches,
        metavar="N",
        help="batches unfinished at once; creating one more is answered 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-stored-bytes",
        default=None,
        metavar="SIZE",
        help="bytes of files (uploads, batch results) the data directory may hold, e.g. 20GiB; "
        "an upload past it is answered 507 (default: no limit but the disk's)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=ServerSettings.header_timeout_s,
        metavar="SECONDS",
        help="close a connection whose request headers have not all arrived this long after "
        "it opened (or after its first byte of a new request) (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=ServerSettings.body_timeout_s,
        metavar="SECONDS",
        help="answer 408 and close when a request body pauses this long (default: %(default)s)",
    )
    parser.add_argument(
        "--body-total-timeout",
        type=float,
        default=ServerSettings.body_total_timeout_s,
        metavar="SECONDS",
        help="answer 408 and close when a request body (an upload included) takes longer than "
        "this in all (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-alive",
        type=int,
        default=ServerSettings.keep_alive_s,
        metavar="SECONDS",
        help="close a kept-alive connection idle this long (default: %(default)s)",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names accepted besides IP addresses and localhost ('*': any)"
        " (default: none)",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated browser origins allowed cross-site (CORS) (default: none)",
    )
    add_media_arguments(parser)
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        help="the model's tool-call format, read for tool_choice auto (default: from the "
        "chat template: openai for gpt-oss's harmony, hermes when it shows none)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=(*REASONING_PARSERS, "none"),
        default=None,
        help="split reasoning into reasoning_content: <think> blocks (qwen3, deepseek_r1) or "
        "gpt-oss's analysis channel (openai_gptoss) (default: from the chat template: "
        "openai_gptoss when it writes harmony channels, qwen3 or deepseek_r1 when it closes "
        "a </think>, else none)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the engine in this process (debugging; default: its own process)",
    )


def uvicorn_config(
    app: FastAPI, settings: ServerSettings, port: int, log_level: str = "info"
) -> DaemonConfig:
    """uvicorn's config for the daemon's app: its address, its connections' deadlines
    (request headers, idle keep-alive), shutdown."""
    return DaemonConfig(
        app,
        header_timeout_s=settings.header_timeout_s,
        host=settings.bind_host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The daemon's listening socket, bound before anything loads; a port in use is one line."""
    try:
        family, _, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}; check --host") from e
    # With the TCP protocol number (not 0) asyncio turns Nagle's algorithm off on every
    # accepted connection (TCP_NODELAY): otherwise a response written as headers, then body
    # waits ~40 ms for the client's delayed ACK on every request of a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not a port in use: TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is already in use (another nanoflex serve?); stop "
                "that process or pass another --port"
            ) from e
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def main(args: argparse.Namespace) -> int:
    """Entry point of `nanoflex serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    keep_heaps_trimmed()
    settings = ServerSettings.from_args(args)
    sock = bind_socket(settings.bind_host, args.port)
    try:
        if args.offload_dir is not None:  # held until exit, by this process and its engine
            lock_offload_dir(Path(args.offload_dir))
        check_data_dir(settings.data_dir)
        failures: list[str] = []
        server: uvicorn.Server | None = None

        def on_fatal(message: str) -> None:
            failures.append(message)
            if server is not None:
                server.should_exit = True

        app = create_app(settings, build_engine_client(args), on_fatal=on_fatal)
        server = uvicorn.Server(uvicorn_config(app, settings, args.port))
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failures:
        raise UserError(failures[0])
    return 0
