"""`EngineClient`: the one seam between the HTTP daemon and whatever generates tokens.

The daemon talks only to this interface. A concrete client drives the torch-free
scheduler (`engine.core.StepLoop`) in the daemon and an executor in a child
process (`engine.runtime.engine_process.ExecutorProcess`), or in-process
(`InProcessExecutor`) behind the same interface for tests.

Contract of `generate`: it yields `SequenceDelta`s for one request of n choices, each
saying what one choice (`delta.index`) gained: new token ids, new text (detokenized, stop
strings cut, nothing ever taken back) and logprobs; a choice's last delta has its
`finish_reason` ("stop" or "length"). The caller adds them up per choice
(`ChoiceAccumulator`). If the engine dies mid-request, `generate` raises
`EngineDeadError`; the daemon answers 503 (online) or re-queues (batch work).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.kv_pages import CacheStats
from engine.core.media import SeqMedia, VisionSpec
from engine.core.outputs import SequenceDelta
from engine.core.pooling import PoolingSpec
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import ONLINE_PRIORITY
from engine.core.tokenizer import ChatOptions


class EngineDeadError(RuntimeError):
    """The engine process died or is restarting; the request did not finish. Retry later."""


class StorageUnavailableError(RuntimeError):
    """The engine's offload storage failed the request (a full disk, an I/O error) or rests
    after such a fault; nothing is wrong with the request. Retry later."""


@dataclass(slots=True)
class StepStats:
    """Per-step figures the engine reports to listeners (feeds /metrics)."""

    step_seconds: float
    batch_size: int
    """Sequences that ran in this step; 0 when no step ran and only the queues changed
    (requests aborted, engine restarted): then only the gauges are updated."""
    num_waiting: int
    num_running: int
    queues: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(waiting, running) sequences per class, 'online' and 'batch' (Scheduler.queue_lengths)."""
    bytes_per_tier: dict[str, int] = field(default_factory=dict)
    """Bytes resident per tier ('gpu', 'cpu', 'disk'): weights + KV + activations."""
    num_preemptions: int = 0
    """Sequences preempted since the engine started (KV dropped, recomputed later)."""
    prefix_cache: CacheStats = field(default_factory=CacheStats)
    """Cumulative prefix-cache figures of the current scheduler (from 0 after a restart)."""
    cached_pages: dict[str, int] = field(default_factory=dict)
    """KV pages kept cached (held by no sequence), per tier."""
    page_bytes: int = 0
    """Bytes of one KV page over all layers (turns page counts into bytes)."""
    used_pages: dict[str, int] = field(default_factory=dict)
    """KV pages held by running sequences, per tier (a leak shows as pages held while idle)."""
    capacity_pages: dict[str, int | None] = field(default_factory=dict)
    """KV pages each tier may hold (None: bounded only by the machine)."""
    offload_faults: int = 0
    """Steps that failed on the offload storage, since the engine (re)started."""
    index_dropped: int = 0
    """Disk-cache index entries dropped at the engine's starts so far (damaged, not ours)."""
    num_restarts: int = 0
    """Times the engine process was restarted after a crash."""


StepListener = Callable[[StepStats], None]
FatalListener = Callable[[str], None]
"""Called once with one line when the engine is gone for good (restarts exhausted)."""


class EngineClient(abc.ABC):
    """The daemon's view of the engine: lifecycle, tokenizer, generation, abort.

    Lifecycle: `await start()` once (loads the model, may take minutes; the daemon serves
    /health meanwhile and /ready shows `status()`), then `is_ready()` is True while the
    engine steps; `await shutdown()` finishes the running step, frees the device and stops
    the child process. The tokenizer and the model's limits may need the model loaded:
    before that they raise `EngineDeadError` (the daemon's 503).
    """

    def __init__(self) -> None:
        self._step_listeners: list[StepListener] = []
        self._fatal_listeners: list[FatalListener] = []

    # -- lifecycle -------------------------------------------------------------------
    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start stepping. Raises a `UserError` with a one-line message
        for a failure that retrying does not change (bad model, no device, out of memory)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop accepting work, let the running step finish, release the engine."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True when the model is loaded and the engine is stepping (GET /ready)."""

    def status(self) -> str:
        """What the engine is doing while not ready (GET /ready's detail), e.g. "loading
        weights: layer 3/30"."""
        return "engine starting or restarting"

    def check_ready(self) -> None:
        """Raise what a request would meet now if the engine cannot take one: by default
        `EngineDeadError` unless `is_ready()`."""
        if not self.is_ready():
            raise EngineDeadError(self.status())

    # -- model and tokenizer ---------------------------------------------------------
    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The id clients put in `model` and see in GET /v1/models."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context window in tokens: prompt + generated tokens must fit."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Valid token ids are 0 <= id < vocab_size."""

    @property
    @abc.abstractmethod
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for: a prompt text of more than
        `max_model_len * max_token_bytes` bytes cannot fit the context window."""

    @property
    @abc.abstractmethod
    def eos_token_id(self) -> int | None:
        """End-of-sequence id (None if the model has none)."""

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for a completion prompt, with the model's usual special tokens (BOS)
        unless `add_special_tokens` is False."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text for token ids, skipping special tokens."""

    @abc.abstractmethod
    def apply_chat_template(
        self, messages: list[dict[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        """Token ids of a chat rendered with the tokenizer's template (`ChatOptions`: the
        generation prompt, tools, template variables)."""

    @property
    def vision(self) -> VisionSpec | None:
        """How the model takes images (its processor's rule, its image token); None: it takes
        text alone. None by default."""
        return None

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        """The model's sampling defaults (generation_config.json) by SamplingParams field:
        what a request that leaves a field out gets. None by default."""
        return {}

    @abc.abstractmethod
    def tokenizer_info(self) -> dict[str, Any]:
        """The served tokenizer's special tokens, chat template and limits (vLLM's GET
        /tokenizer_info), so a harness can use it instead of guessing a hub id."""

    # -- generation ------------------------------------------------------------------
    @abc.abstractmethod
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = ONLINE_PRIORITY,
        *,
        stream: bool = True,
        media: SeqMedia | None = None,
    ) -> AsyncGenerator[SequenceDelta, None]:
        """Queue one request of `params.n` choices and yield what each choice gains, until
        every choice finished; leaving early aborts the rest. `stream` False: each choice is
        yielded once, finished, its deltas added up (its `first_token_time` set). `media`: the
        prompt's images, their tokens already in `prompt_token_ids` (engine/core/media.py).

        Lower `priority` runs first. Implement as an `async def ... yield`.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Drop a request (every choice) wherever it is and free its KV. Idempotent."""

    # -- pooling ---------------------------------------------------------------------
    @property
    def pooling_spec(self) -> PoolingSpec | None:
        """What a pooling model serves (engine/core/pooling.py); None: it generates."""
        return None

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A scoring model's input for one (query, document) pair: token ids and token type
        ids (0 query, 1 document)."""
        raise NotImplementedError(f"{self.model_name} does not score pairs")

    async def embed(
        self, inputs: list[list[int]], priority: int = ONLINE_PRIORITY
    ) -> list[list[float]]:
        """One vector per input's token ids, pooled and normalized as the model declares."""
        raise NotImplementedError(f"{self.model_name} does not embed")

    async def score(
        self, pairs: list[tuple[list[int], list[int]]], priority: int = ONLINE_PRIORITY
    ) -> list[float]:
        """A scoring model's relevance per pair (`encode_pair`'s)."""
        raise NotImplementedError(f"{self.model_name} does not score pairs")

    # -- stats -----------------------------------------------------------------------
    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener` after every engine step (used by /metrics)."""
        self._step_listeners.append(listener)

    def emit_step(self, stats: StepStats) -> None:
        """Concrete clients call this once per finished step."""
        for listener in self._step_listeners:
            listener(stats)

    def add_fatal_listener(self, listener: FatalListener) -> None:
        """Call `listener` (from any thread) when the engine is gone for good."""
        self._fatal_listeners.append(listener)

    def emit_fatal(self, message: str) -> None:
        """Concrete clients call this once when they give up restarting the engine."""
        for listener in self._fatal_listeners:
            listener(message)
