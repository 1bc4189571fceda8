"""`nanoflex serve`: build the engine client and the app, run uvicorn, shut down gracefully.

The engine client comes from a factory `module:function(args) -> EngineClient`,
by default `server.core_client:build_engine_client`; the environment variable
NANOFLEX_ENGINE_CLIENT names another (a different backend or a test double).
uvicorn turns SIGTERM/SIGINT into a graceful shutdown:
stop accepting, finish in-flight responses, stop batch work (pending requests
stay in the store), shut the engine down, close the store.

The data directory is checked before the model loads, so a damaged or unwritable
one ends the command at once with one `nanoflex serve: error: ...` line.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from engine.core.engine_args import EngineArgs
from policy.errors import UserError
from server.app import create_app
from server.data_dir import check_data_dir
from server.engine_client import EngineClient
from server.settings import API_KEY_ENV, ServerSettings

DEFAULT_ENGINE_CLIENT = "server.core_client:build_engine_client"
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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--data-dir", default="nanoflex-data", help="SQLite store, files, results")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require this bearer token (visible in ps: prefer ${API_KEY_ENV} or --api-key-file)",
    )
    parser.add_argument("--api-key-file", default=None, help="read the bearer token from FILE")
    parser.add_argument(
        "--max-queue", type=int, default=1024, help="online sequences in flight before 429"
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names accepted besides IP addresses and localhost ('*': any)",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated browser origins allowed cross-site (CORS); none by default",
    )
    parser.add_argument("--in-process", action="store_true", help="run the engine in this process")


def uvicorn_config(
    app: FastAPI, settings: ServerSettings, port: int, log_level: str = "info"
) -> uvicorn.Config:
    """uvicorn's config for the daemon's app: its address, keep-alive timeout, shutdown."""
    return uvicorn.Config(
        app,
        host=settings.bind_host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `nanoflex serve`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = ServerSettings.from_args(args)
    check_data_dir(settings)
    app = create_app(settings, build_engine_client(args))
    uvicorn.Server(uvicorn_config(app, settings, args.port)).run()
    return 0
