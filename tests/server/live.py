"""Helpers: a real uvicorn server on loopback over the real engine (demo model), and clients.

The engine is `StepLoopClient` on the built-in demo model on CPU, with the
executor in this process (`in_process=True`) unless a test needs the child
process. `reference` is the offline `engine.LLM` on the same model: greedy
output from the daemon must equal its greedy output for the same token ids.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from engine.core.model_files import DEMO_MODEL
from engine.core.outputs import CompletionOutput
from engine.core.sampling_params import SamplingParams
from engine.core.tokenizer import Tokenizer
from engine.loading.demo import demo_model_dir
from engine.runtime.engine_client import EngineClient
from engine.runtime.step_loop_client import StepLoopClient, build_engine_client
from policy import Policy
from server.cli import build_parser
from server.http.app import create_app
from server.http.serve import bind_socket, uvicorn_config
from server.http.settings import ServerSettings
from server.http.state import AppState

API_KEY = "test-key"
MODEL = DEMO_MODEL


def engine_args(**overrides: Any) -> argparse.Namespace:
    """`nanoflex serve --device cpu` arguments (the demo model), with the default `Policy()`
    fixed so that nothing is planned and the reference runs the same policy."""
    args = build_parser("serve").parse_args(
        ["serve", "--model", DEMO_MODEL, "--device", "cpu", "--in-process"]
    )
    args.policy = Policy()
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def demo_engine(in_process: bool = True) -> StepLoopClient:
    """The daemon's real engine client on the demo model (not started)."""
    return build_engine_client(engine_args(in_process=in_process))


@dataclass
class LiveServer:
    """A daemon running in a thread; `state` is the app's shared state."""

    base_url: str
    engine: EngineClient
    state: AppState
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    settings: ServerSettings, engine: EngineClient, *, wait_ready: bool = True
) -> LiveServer:
    """uvicorn on a free loopback port; with `wait_ready`, returns once the engine, which
    loads in the background, is ready (and fails if it cannot start)."""
    app = create_app(settings, engine)
    sock = bind_socket("127.0.0.1", 0)  # the daemon's own listening socket, on a free port
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn_config(app, settings, port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # a loaded 2-core box takes minutes to start the first engine
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    state: AppState = app.state.nanoflex
    while wait_ready and not engine.is_ready():
        if state.engine_error is not None or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the engine did not start: {state.engine_error}")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", engine, state, server, thread, settings.api_key)


ServerFactory = Callable[..., LiveServer]


class Reference:
    """The offline engine (`engine.LLM`) on the demo model: what the daemon must reproduce."""

    def __init__(self) -> None:
        from engine.llm import LLM  # imports torch: only tests that compare outputs pay for it

        self.llm = LLM(DEMO_MODEL, policy=Policy(), device="cpu")
        self.tokenizer = Tokenizer(demo_model_dir())
        self._cache: dict[tuple[Any, ...], list[CompletionOutput]] = {}

    def greedy_many(
        self, prompts: Sequence[Sequence[int] | str], max_tokens: int, **params: Any
    ) -> list[CompletionOutput]:
        """Greedy outputs for token-id prompts (strings are encoded as the daemon does)."""
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        key = (tuple(map(tuple, ids)), max_tokens, repr(sorted(params.items())))
        if key not in self._cache:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
            outputs = self.llm.generate(ids, sampling)
            self._cache[key] = [out.outputs[0] for out in outputs]
        return self._cache[key]

    def greedy(
        self, prompt: Sequence[int] | str, max_tokens: int, **params: Any
    ) -> CompletionOutput:
        return self.greedy_many([prompt], max_tokens, **params)[0]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)


def engine_is_idle(engine: EngineClient) -> bool:
    """No request left in the real engine's scheduler and every KV page free (read from the
    test thread: a snapshot, good enough to wait on)."""
    assert isinstance(engine, StepLoopClient)
    core = engine._step_loop
    if core is None or core.has_unfinished():
        return False
    manager = core.scheduler.page_manager
    return all(manager.num_used_pages(tier) == 0 for tier in ("gpu", "cpu", "disk"))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
