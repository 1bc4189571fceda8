"""Fault injection for the server tests: engine clients that fail or block on marked prompts,
and a data directory or an offload directory on a small tmpfs that can be filled to the last
byte.

The engines are the real `StepLoopClient` on the demo model with one method overridden; the
full disk is a real tmpfs mount when this machine allows mounting (root in CI), else the
store's and the file storage's writes (or the engine's disk-tier writes) raise ENOSPC while
the disk is "full".
"""

from __future__ import annotations

import asyncio
import errno
import subprocess
import threading
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.core.media import SeqMedia
from engine.core.outputs import SequenceDelta
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY
from engine.runtime.step_loop_client import StepLoopClient
from server.http.state import AppState
from tests.server.live import demo_engine

FAIL_IN_ENGINE = "FAIL-IN-ENGINE"
"""A prompt containing this makes `FaultyEngine.generate` raise, as an engine bug would."""
FAIL_IN_TOKENIZER = "FAIL-IN-TOKENIZER"
"""A prompt containing this makes `FaultyEngine.encode` raise."""
BLOCK = "BLOCK-IN-TOKENIZER"
"""A prompt containing this makes `BlockingEngine.encode` wait until released."""
HOLD = "HOLD-FIRST-TOKEN"
"""A prompt containing this makes `FaultyEngine.generate` wait for `FaultyEngine.release`
before it starts (as a first token that takes a while when the engine is busy elsewhere)."""


def like_demo(cls: type[StepLoopClient]) -> Any:
    """An engine client of class `cls` built exactly as the daemon's demo engine."""
    base = demo_engine()
    return cls(
        base.engine_args, base.model_dir, base.policy, model_name=base.model_name, in_process=True
    )


class FaultyEngine(StepLoopClient):
    """Raises RuntimeError in `encode` or `generate` for marked prompts, or holds `generate`
    (`held` is set once it waits, `release` lets it go), or holds `start` (`may_start`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = threading.Event()
        self.release = threading.Event()
        self.may_start = threading.Event()
        """Cleared: `start` waits until it is set (the model loading for as long)."""
        self.may_start.set()

    async def start(self) -> None:
        while not self.may_start.is_set():
            await asyncio.sleep(0.01)
        await super().start()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if FAIL_IN_TOKENIZER in text:
            raise RuntimeError("injected tokenizer failure")
        return super().encode(text, add_special_tokens)

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
        text = self.decode(prompt_token_ids)
        if FAIL_IN_ENGINE in text:
            raise RuntimeError("injected engine failure")
        if HOLD in text:
            self.held.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        deltas = super().generate(
            request_id, prompt_token_ids, params, priority, stream=stream, media=media
        )
        async for output in deltas:
            yield output


class BlockingEngine(StepLoopClient):
    """`encode` of a marked prompt waits for `release`; `entered` is set once it waits."""

    entered = threading.Event()
    release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if BLOCK in text:
            self.entered.set()
            assert self.release.wait(60), "the test never released the tokenizer"
        return super().encode(text, add_special_tokens)


class Disk:
    """A data directory whose disk can be filled and freed."""

    def __init__(self, data_dir: Path, mounted: bool) -> None:
        self.data_dir = data_dir
        self.mounted = mounted
        self._filler = data_dir.parent / "filler" if not mounted else data_dir / "filler"
        self._state: AppState | None = None
        self._full = False

    def attach(self, state: AppState) -> None:
        """Without a tmpfs: make the server's store and file storage fail while full."""
        if self.mounted:
            return
        self._state = state
        _inject_enospc(state, lambda: self._full)

    def fill(self) -> None:
        self._full = True
        if self.mounted:
            fill_to_the_last_byte(self._filler)

    def free(self) -> None:
        self._full = False
        self._filler.unlink(missing_ok=True)


def _inject_enospc(state: AppState, is_full: Any) -> None:
    from server.batch.storage_faults import StorageError

    def failing(method: Any, what: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if is_full():
                raise StorageError(f"{what} failed: No space left on device", is_full=True)
            return method(*args, **kwargs)

        return wrapper

    store, storage = state.store, state.storage
    for name in ("commit_result", "insert_file", "insert_batch", "finalize_batch"):
        setattr(store, name, failing(getattr(store, name), "writing the database"))
    for name in ("open_upload", "write_lines"):
        setattr(storage, name, failing(getattr(storage, name), "writing a file"))


def fill_to_the_last_byte(filler: Path) -> None:
    """Write `filler` until the kernel says the disk is full (unbuffered: no write is left
    pending for the close to retry)."""
    block = b"\0" * (1 << 16)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                while block:  # the last write may take part of a block
                    block = block[f.write(block) :]
                block = b"\0" * (1 << 16)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


@contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[bool]:
    """`directory` (made) on a tmpfs of `size` while inside; False where mounting is not
    allowed (not root): then it is a plain directory."""
    directory.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Disk]:
    """A 16 MiB tmpfs for the data directory (or, where mounting is not allowed, a plain
    directory with injected ENOSPC)."""
    with tmpfs(tmp_path / "data", "16m") as mounted:
        yield Disk(tmp_path / "data", mounted)
