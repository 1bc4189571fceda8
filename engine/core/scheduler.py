"""`Scheduler`: the global batch scheduler (NanoFlow 4.2, 4.4), torch-free.

Each `schedule()` refills the running block from priority queues, gives every
running sequence its decode token and fills the rest of a discrete dense batch
size with prefill chunks; KV admission uses projected peak pages per tier and,
when a projection proves wrong, the newest sequence is preempted and later
recomputed. The n choices of one request (`Request.group`) compute their prompt once: the
first to sample forks its pages to the others (`PageManager.fork`), which sample their first
token from its logits row and wait in the queue holding their KV. `postprocess()` applies
sampled tokens and hands back what each request gained (`SequenceDelta`); `recover()` takes
a step the executor could not run (its offload storage failed, a cached page failed
verification) and recomputes its sequences. Every request has one choice: `ParentRequest`
fans out n in front.
Plans may be built one step ahead (asynchronous): a decode whose input token is
still in flight carries PENDING_TOKEN_ID, and a token sampled for a sequence
that has meanwhile finished is dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.detokenizer import Detokenizer
from engine.core.kv_pages import PageManager, pick_tier
from engine.core.outputs import SequenceDelta
from engine.core.prefix_cache import PageRef
from engine.core.prefix_order import (
    LOOKAHEAD,
    PageHashes,
    PrefixGate,
    PrefixQueue,
    prompt_page_hashes,
)
from engine.core.protocol import PENDING_TOKEN_ID, SeqChunk, StepFailure, StepPlan, StepResult
from engine.core.sequence import BATCH_PRIORITY, Request, Sequence, SequenceStatus
from engine.core.state_slots import StateSlots, StateSnapshots
from engine.core.tier_rest import TierRest, largest_pool_tokens, pool_tokens
from policy import TIERS, Policy, UserError
from policy.policy import Triple


class SchedulerConfigError(UserError, ValueError):
    """Scheduler settings that cannot work together (say which flag to change)."""


class RequestError(UserError, ValueError):
    """A request the scheduler refuses: duplicate id, empty prompt, or one that can never fit."""


class PromptTooLongError(RequestError):
    """The prompt is longer than max_model_len."""


class EngineProtocolError(RuntimeError):
    """A StepResult that does not answer its StepPlan (a bug in the executor)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler forms steps; build with `from_policy` or by keyword."""

    gpu_batch_size: int = 8
    """Sequences per GPU batch; gpu_batch = slot // gpu_batch_size."""
    num_gpu_batches: int = 1
    """GPU batches per block; block_size = gpu_batch_size * num_gpu_batches."""
    kv_frac: Triple = (1.0, 0.0, 0.0)
    """Target share of sequences whose KV is homed on gpu / cpu / disk."""
    act_frac: Triple = (1.0, 0.0, 0.0)
    """Target share of sequences whose activations are homed on gpu / cpu / disk."""
    page_tokens: int = 16
    """Tokens per KV page."""
    kv_capacity_pages: dict[str, int | None] = field(default_factory=dict)
    """KV pages available per tier; a missing tier or None is unbounded."""
    state_slots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's per-sequence state slots per tier (engine/core/state_slots.py): a
    sequence is admitted only with a free one on its state tier; empty: no state layers."""
    state_snapshots: dict[str, int] = field(default_factory=dict)
    """A hybrid model's snapshot slots for the states of cached prefixes (`StateSnapshots`):
    {tier: count}, numbered after that tier's `state_slots`; none turns its prefix caching
    off."""
    max_step_tokens: int = 2048
    """Most tokens (decodes plus prefill chunks) in one step."""
    batch_sizes: tuple[int, ...] = ()
    """The discrete dense batch sizes a step runs (NanoFlow 4.2), ascending; empty:
    `discrete_sizes(max_step_tokens, None, block_size)`."""
    discrete_batching: bool = True
    """Fill each step to one of batch_sizes and pad the rest (fixed shapes: CUDA graphs,
    tuned kernels); False runs exactly the scheduled tokens, budgeted by max_step_tokens."""
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2048
    """Context window: prompt plus generated tokens."""
    expected_gen_tokens: int | None = None
    """Generated length KV admission assumes per request (capped by its max_tokens): a fixed
    number, or None for NanoFlow's estimate (4.4), the running mean output length of the
    finished requests (max_tokens until one has finished). A wrong estimate is caught by
    preemption, never by running out of pages."""
    conservative_admission: bool = False
    """Assume every request runs to max_tokens: nothing is ever preempted, but fewer
    sequences run at once when most stop early."""
    enable_prefix_caching: bool = False
    """Keep finished sequences' full KV pages cached (spilling LRU pages down the tiers) and
    let new requests reuse the longest cached prefix instead of recomputing it."""
    cache_salt: str = ""
    """Mixed into every page hash: what else determines the KV bytes (EngineInfo.cache_salt)."""
    max_cached_pages: dict[str, int] = field(default_factory=dict)
    """Per tier, the most cached pages nobody holds (the disk cache's size bound)."""
    min_hit_tokens: dict[str, int] = field(default_factory=dict)
    """Per tier, the shortest cached prefix worth loading from there instead of recomputing
    (the cost model's break-even); a shorter hit on that tier is recomputed."""
    static_blocks: bool = False
    """FlexGen-style baseline: admit only into an empty block, so a block runs to completion
    before the next starts (no refill). False: continuous refill after every step."""
    offload_retry_s: float = 2.0
    """After a tier's storage failed in a step (a full disk, an I/O error), how long it takes
    no new KV (no sequence homed there, no spill, no hit read there); then it is tried again."""
    prefix_ordering: bool = True
    """With prefix caching: batch work waits in the trie order of its prompts' page hashes, so
    lines that share a prefix run back to back while it is cached, and a prompt whose next
    uncached page a running sequence is computing waits a step to hit it (`PrefixQueue`,
    `PrefixGate`). False: FIFO, and shared pages computed at once are computed twice."""
    batch_share: float = 0.25
    """While online requests wait or run, the most batch work takes: this share of a step's
    token budget for its prefill chunks and of the block's slots (rounded up) for its lines.
    Batch lines past it are never preempted; new ones wait. 1.0: priority alone."""
    max_offload_faults: int = 2
    """Storage faults a sequence goes through (recomputed after each); at this many it ends
    with a retryable error instead (`SequenceDelta.retryable`)."""

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches", "page_tokens", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 1:
            raise SchedulerConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        sizes = self.batch_sizes or discrete_sizes(self.max_step_tokens, None, self.block_size)
        sizes = tuple(sorted(set(sizes)))
        if sizes[0] < 1 or sizes[-1] > self.max_step_tokens:
            raise SchedulerConfigError(f"batch_sizes must lie in [1, max_step_tokens], got {sizes}")
        if sizes[-1] < self.block_size:
            raise SchedulerConfigError(
                f"the largest batch size ({sizes[-1]}) must hold one decode per sequence of the "
                f"block ({self.block_size}): raise max_step_tokens or lower the block size"
            )
        object.__setattr__(self, "batch_sizes", sizes)
        if not 0.0 < self.batch_share <= 1.0:
            raise SchedulerConfigError(f"batch_share must lie in (0, 1], got {self.batch_share}")
        unknown = set(self.kv_capacity_pages) - set(TIERS)
        if unknown:
            raise SchedulerConfigError(f"kv_capacity_pages has unknown tiers {sorted(unknown)}")

    @property
    def block_size(self) -> int:
        """Most sequences running at once (Policy.block_size)."""
        return self.gpu_batch_size * self.num_gpu_batches

    @classmethod
    def from_policy(cls, policy: Policy, **kwargs: object) -> SchedulerConfig:
        """Block shape and tier fractions from `policy`; everything else by keyword."""
        shape = {"gpu_batch_size": policy.gpu_batch_size, "num_gpu_batches": policy.num_gpu_batches}
        fracs = {"kv_frac": policy.kv_frac, "act_frac": policy.act_frac}
        return cls(**shape, **fracs, **kwargs)  # type: ignore[arg-type]


SIZES_PER_OCTAVE = 8
"""Discrete sizes between a power of two and the next, above the flat rows."""


def discrete_sizes(max_rows: int, flat_rows: int | None, block_size: int) -> tuple[int, ...]:
    """The dense batch sizes a step may run (NanoFlow 4.2): powers of two up to `flat_rows`,
    the rows below which a dense step's time does not grow (the device is under-used, so
    padding up is free); above them 8 sizes an octave, so that padding adds at most an
    eighth of a step's rows where every row costs time; the block size (a full block's
    decodes run unpadded) and max_rows. flat_rows None: 1 (every row costs)."""
    flat = max(1, min(flat_rows or 1, max_rows))
    base = 1 << (flat.bit_length() - 1)  # the largest power of two within the flat rows
    sizes = {1 << i for i in range(base.bit_length())}
    while base <= max_rows:
        step = max(1, base // SIZES_PER_OCTAVE)
        sizes |= set(range(base, min(2 * base, max_rows + 1), step))
        base *= 2
    sizes |= {min(block_size, max_rows), max_rows}
    return tuple(sorted(sizes))


def pick_size(batch_sizes: tuple[int, ...], num_tokens: int) -> int:
    """The dense size a step of `num_tokens` runs padded to: the smallest of `batch_sizes`
    that holds them, else the largest."""
    return next((s for s in batch_sizes if s >= num_tokens), batch_sizes[-1])


class Scheduler:
    """Decides what every step runs; owns the queues, the KV page tables and the slots.

    Not thread-safe: one driver (EngineCore) calls it. Contract per step:
    `plan = schedule()`, run it, `postprocess(plan, result)`. Asynchronous
    drivers may call `schedule()` once more before the previous postprocess.
    """

    def __init__(self, config: SchedulerConfig, detokenizer: Detokenizer | None = None) -> None:
        self.config = config
        self.detokenizer = detokenizer
        self.state_slots = StateSlots(config.state_slots)
        """Each running sequence's state slot, for a hybrid model."""
        hybrid = self.state_slots.enabled
        # a hybrid's cached prefix is usable only with the state at its end (StateSnapshots)
        snapshots = next(iter(config.state_snapshots.items()), ("cpu", 0))
        caching = config.enable_prefix_caching and (not hybrid or snapshots[1] > 0)
        self.page_manager = PageManager(
            config.page_tokens,
            config.kv_capacity_pages,
            prefix_caching=caching,
            salt=config.cache_salt,
            max_cached_pages=config.max_cached_pages,
        )
        self.snapshots = StateSnapshots(
            snapshots[0],
            snapshots[1] if caching and hybrid else 0,
            self.state_slots.capacity.get(snapshots[0], 0),
            self.page_manager.stats,
        )
        """A hybrid's saved states at the end of shared prefixes (its prefix cache)."""
        self.waiting: dict[int, deque[Sequence] | PrefixQueue[Sequence]] = {}
        """Queues per priority (lower first), FIFO (batch work in prefix order with
        prefix_ordering); preempted sequences go back to the front."""
        self.prefix_ordering = config.prefix_ordering and self.page_manager.prefix_caching
        self.forking = caching and not hybrid
        """The n choices of a request share one prefill (a hybrid's state is not forked)."""
        self._groups: dict[str, list[Sequence]] = {}
        """With forking: the unfinished choices of each request with n > 1, by group."""
        self._prompt_hashes: dict[int, PageHashes] = {}
        """With prefix_ordering: each unfinished sequence's prompt page hashes."""
        self.running: list[Sequence] = []
        """Admission order: the last one is the newest (the first to preempt)."""
        self.requests: dict[str, Sequence] = {}
        self._seqs: dict[int, Sequence] = {}
        self._free_slots = list(range(config.block_size))
        self._freed_seq_ids: list[int] = []
        self.num_preemptions = 0
        """Sequences preempted so far (their KV dropped, to be recomputed)."""
        self._finished_gen_tokens = 0  # over requests that ended on their own (stop, length)
        self._num_finished = 0
        self._next_seq_id = 0
        self._next_step_id = 0
        self._plan_epochs: dict[int, dict[int, int]] = {}
        """Per plan in flight: each sequence's epoch when planned (prefix caching indexes a
        sequence's pages after a step only if it was not preempted meanwhile)."""
        self.kv_tokens = largest_pool_tokens(
            self.page_manager.capacity_pages, config.kv_frac, config.page_tokens
        )
        """Tokens the largest allowed KV pool holds: the most one sequence can ever have in KV."""
        self.max_len = min(config.max_model_len, self.kv_tokens + 1)
        """Sequences end ('length') at this many tokens, so a lone one always fits a pool."""
        self._batch_budget = config.max_step_tokens
        """Prefill tokens batch work may still take in the step being planned."""
        self.rest = TierRest(config.offload_retry_s)
        """The tiers that rest after a storage fault (read from the daemon's event loop too)."""

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestError for one that can never run."""
        num_prompt = len(request.prompt_token_ids)
        if request.sampling.n != 1:
            raise RequestError(
                f"request {request.request_id!r} asks for n={request.sampling.n}; the engine "
                "runs one choice per request (ParentRequest fans out n)"
            )
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if num_prompt == 0:
            raise RequestError("the prompt is empty: send at least one token")
        if num_prompt > self.config.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt} tokens but max_model_len is "
                f"{self.config.max_model_len}: shorten the prompt"
            )
        if num_prompt > self.kv_tokens:
            raise RequestError(
                f"the prompt ({num_prompt} tokens) does not fit the largest KV pool "
                f"({self.kv_tokens} tokens): give the KV cache more memory"
            )
        seq = Sequence.from_request(request, self._next_seq_id, self.detokenizer)
        self._next_seq_id += 1
        self.requests[request.request_id] = seq
        self._seqs[seq.seq_id] = seq
        if self.prefix_ordering:
            self._prompt_hashes[seq.seq_id] = prompt_page_hashes(
                seq.cache_token_ids, self.config.page_tokens, self.config.cache_salt
            )
        if self.forking and request.group is not None:
            self._groups.setdefault(request.group, []).append(seq)
        if request.priority not in self.waiting:
            self.waiting[request.priority] = self._new_queue(request.priority)
        self.waiting[request.priority].append(seq)

    def _new_queue(self, priority: int) -> deque[Sequence] | PrefixQueue[Sequence]:
        if self.prefix_ordering and priority >= BATCH_PRIORITY:
            return PrefixQueue(lambda seq: self._prompt_hashes[seq.seq_id])
        return deque()

    def abort_request(self, request_id: str) -> SequenceDelta | None:
        """Drop a request wherever it is and free its KV; its last delta ('abort'), or None
        if unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._retire(seq)
        return seq.abort()

    def has_unfinished(self) -> bool:
        """Requests remain, or records the executor has not seen yet (pages newly cached on
        disk: the persistent index must hear of them even when no request runs again)."""
        return bool(self.requests) or self.page_manager.has_unsent_records

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """(waiting, running) sequences of the online and the batch class."""
        counts = {"online": [0, 0], "batch": [0, 0]}
        for priority, queue in self.waiting.items():
            counts["batch" if priority >= BATCH_PRIORITY else "online"][0] += len(queue)
        for seq in self.running:
            counts["batch" if seq.request.priority >= BATCH_PRIORITY else "online"][1] += 1
        return {name: (waiting, running) for name, (waiting, running) in counts.items()}

    # -- schedule ----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run now."""
        self.page_manager.paused = self.rest.tiers()
        live = [s for s in self.running if not s.will_finish(self.max_len)]
        num_decodes = sum(1 for s in live if s.num_tokens - s.num_computed_tokens == 1)
        demand = sum(s.num_tokens - s.num_computed_tokens for s in live)
        can_admit = not self.config.static_blocks or not self.running
        num_joining = len(self._free_slots) if can_admit else 0
        queued = itertools.islice(itertools.chain(*self._queues()), num_joining)
        demand += sum(s.num_tokens - s.num_computed_tokens for s in queued)
        step_tokens = self._pick_size(demand) if self.config.discrete_batching else None
        budget = (step_tokens or self.config.max_step_tokens) - num_decodes  # prefill tokens

        planned: list[tuple[int, SeqChunk]] = []
        preempted = False
        self._batch_budget = self._batch_tokens()
        for seq in live:  # oldest first; victims are always newer or seq itself
            if seq.status is not SequenceStatus.RUNNING:
                continue
            to_run = seq.num_tokens - seq.num_computed_tokens
            num_new = 1 if to_run == 1 else min(to_run, self._prefill_budget(seq, budget))
            num_new = self._until_state_save(seq, seq.num_computed_tokens, num_new)
            if num_new == 0:
                continue
            page_ids = self._allocate(seq, num_new)
            if page_ids is None:
                preempted = True
                continue
            budget -= num_new if to_run > 1 else 0
            self._spend(seq, num_new if to_run > 1 else 0)
            planned.append((seq.slot, self._chunk(seq, num_new, page_ids)))
        if not planned:  # the budget reserved for preempted decodes is free again
            budget = self.config.max_step_tokens
        can_admit = can_admit or not self.running  # preemption may have emptied the block
        while can_admit and (not preempted or not planned) and budget > 0 and self._free_slots:
            admitted = self._admit(budget)
            if admitted is None:
                break
            seq, num_new, page_ids = admitted
            budget -= num_new
            self._spend(seq, num_new)
            planned.append((seq.slot, self._chunk(seq, num_new, page_ids)))
        if not planned:
            return self._records_plan()
        chunks = [chunk for _, chunk in sorted(planned, key=lambda p: p[0])]
        chunks += [fork for chunk in chunks for fork in self._forks(chunk)]
        plan = StepPlan(self._next_step_id, chunks, self._freed_seq_ids)
        plan.page_moves, plan.cached_disk_pages = self.page_manager.take_moves()
        plan.page_copies = self.page_manager.take_copies()
        plan.disk_hits = self.page_manager.take_disk_hits()
        if self.page_manager.prefix_caching:
            self._plan_epochs[plan.step_id] = {c.seq_id: self._seqs[c.seq_id].epoch for c in chunks}
        discrete = self.config.discrete_batching
        plan.dense_size = self._pick_size(plan.num_tokens) if discrete else plan.num_tokens
        self._next_step_id += 1
        self._freed_seq_ids = []
        return plan

    def _records_plan(self) -> StepPlan | None:
        """With nothing to run: a plan of records only (no chunks, no forward pass) when the
        executor has some to hear, else None."""
        if not self.page_manager.has_unsent_records:
            return None
        cached = self.page_manager.take_cached_disk_pages()  # moves wait for a real step
        plan = StepPlan(self._next_step_id, [], self._freed_seq_ids, cached)
        self._next_step_id += 1
        self._freed_seq_ids = []
        return plan

    def _pick_size(self, num_tokens: int) -> int:
        return pick_size(self.config.batch_sizes, num_tokens)

    def _chunk(self, seq: Sequence, num_new: int, pages: list[PageRef]) -> SeqChunk:
        start = seq.num_computed_tokens
        known = seq.token_ids[start : start + num_new]
        token_ids = known + [PENDING_TOKEN_ID] * (num_new - len(known))
        seq.num_computed_tokens += num_new
        do_sample = seq.num_computed_tokens == seq.num_tokens
        save = None
        if seq.state_save is not None and seq.state_save[0] == seq.num_computed_tokens:
            save = self.snapshots.reserve(self._next_step_id, seq.state_save[1])
            seq.state_save = None
        chunk = SeqChunk(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            start_pos=start,
            gpu_batch=seq.slot // self.config.gpu_batch_size,
            new_pages=pages,
            kv_tier=seq.kv_tier,
            act_tier=seq.act_tier,
            do_sample=do_sample,
            sampling=None if seq.is_sent else seq.sampling,
            media=None if seq.is_sent else seq.request.media,
            state_slot=self.state_slots.slot_of(seq.seq_id),
            state_restore=seq.state_restore,
            state_save=save,
            num_sampled=seq.num_generated + seq.num_pending,
            cached_token_ids=seq.token_ids[:start]
            if not seq.is_sent and seq.sampling.needs_history
            else [],
        )
        seq.is_sent = True
        seq.state_restore = None  # sent with the first chunk
        seq.num_pending += int(do_sample)
        return chunk

    def _forks(self, chunk: SeqChunk) -> list[SeqChunk]:
        """With `chunk` a choice samples its first token: the other choices of its request
        that have not started fork its pages (a partial last page is copied when first
        written), each a chunk of no tokens that samples from the same logits row."""
        leader = self._seqs[chunk.seq_id]
        if not (chunk.do_sample and leader.num_pending == 1 and self._leads_fork(leader)):
            return []
        group = self._groups[leader.request.group or ""]
        return [self._fork(leader, seq, chunk) for seq in group if self._can_fork(seq)]

    def _leads_fork(self, seq: Sequence) -> bool:
        """seq computes the prompt of a request whose other choices fork it at seq's first
        sample (`_forks`); not a sequence homed on disk (its partial pages are staged in host
        memory, not copied)."""
        return seq.request.group in self._groups and not seq.num_generated and seq.kv_tier != "disk"

    def _can_fork(self, seq: Sequence) -> bool:
        """seq waits and has computed nothing (and wants no prompt logprobs: those need its
        own pass over the prompt)."""
        return (
            seq.status is SequenceStatus.WAITING
            and seq.seq_id not in self.page_manager
            and not seq.num_pending
            and not seq.num_generated
            and not seq.wants_prompt_logprobs
        )

    def _fork(self, leader: Sequence, seq: Sequence, chunk: SeqChunk) -> SeqChunk:
        """seq takes leader's prompt KV; it stays queued, holding it, until a slot is free."""
        pages = self.page_manager.fork(leader.seq_id, seq.seq_id)
        seq.kv_tier, seq.act_tier = leader.kv_tier, leader.act_tier
        seq.num_computed_tokens = leader.num_computed_tokens
        if seq.num_cached_tokens is None:  # the request's prefix hit, as its leader's
            seq.num_cached_tokens = leader.num_cached_tokens
        history = list(seq.token_ids) if seq.sampling.needs_history else []
        seq.is_sent, seq.num_pending = True, 1
        return SeqChunk(
            seq_id=seq.seq_id,
            token_ids=[],
            start_pos=seq.num_computed_tokens,
            gpu_batch=chunk.gpu_batch,
            new_pages=pages,
            kv_tier=seq.kv_tier,
            act_tier=seq.act_tier,
            do_sample=True,
            sampling=seq.sampling,
            media=seq.request.media,  # its M-RoPE positions past the prompt; nothing to encode
            cached_token_ids=history,
            forked_from=leader.seq_id,
        )

    # -- KV: allocation, admission, preemption ----------------------------------------------
    def _allocate(self, seq: Sequence, num_new: int) -> list[PageRef] | None:
        """Pages for seq's next tokens, preempting newer ones on its tier; None if seq went."""
        while not self.page_manager.can_append(seq.seq_id, num_new):
            victim = next(s for s in reversed(self.running) if s.kv_tier == seq.kv_tier)
            self._preempt(victim)
            if victim is seq:
                return None
        return self.page_manager.append(seq.seq_id, num_new)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's KV and queue it at the front of its queue, to be recomputed later."""
        self.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        seq.state_restore = seq.state_save = None  # looked up again when readmitted
        self.waiting[seq.request.priority].appendleft(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free seq's KV and slot: nothing a plan built before did for it counts (its epoch),
        and it computes its tokens again from the first."""
        seq.epoch += 1
        self._release(seq)
        seq.num_computed_tokens = 0

    def _admit(self, budget: int) -> tuple[Sequence, int, list[PageRef]] | None:
        """Move the head of the queues into the block if its projected KV fits some tier.
        With prefix caching its longest cached prefix is taken, not recomputed, unless it
        wants its prompt's logprobs (as vLLM does): those need the logits at every prompt
        position, which a cached prefix never computes."""
        seq = self._next_to_admit()
        if seq is None or seq.num_pending:
            return None
        budget = self._prefill_budget(seq, budget)
        if budget == 0:
            return None
        if seq.seq_id in self.page_manager:  # a fork: it holds its prompt's KV already
            return self._admit_fork(seq, budget)
        prefix: list[PageRef] = []
        restore, save = None, None
        if not seq.wants_prompt_logprobs:  # those need every prompt position's logits
            match = self.page_manager.match(seq.cache_token_ids)
            prefix = self._worth_loading(match)
            if self.snapshots.enabled:
                prefix, restore, save = self._with_states(match, prefix)
        num_cached = len(prefix) * self.config.page_tokens
        num_new = min(seq.num_tokens - num_cached, budget)
        if save is not None and save[0] < num_cached + num_new:
            num_new = save[0] - num_cached  # the first chunk ends where the state is saved
        counts = {t: 0 for t in TIERS}
        for s in self.running:
            counts[s.kv_tier] += 1
        paused = self.page_manager.paused
        fracs = tuple(
            f
            if f > 0
            and t not in paused
            and self.state_slots.can_allocate(t)
            and self._kv_fits(seq, num_new, t)
            else 0.0
            for t, f in zip(TIERS, self.config.kv_frac, strict=True)
        )
        if not any(fracs):
            return None
        seq.kv_tier = pick_tier((fracs[0], fracs[1], fracs[2]), counts)
        act_counts = {t: sum(1 for s in self.running if s.act_tier == t) for t in TIERS}
        seq.act_tier = pick_tier(self.config.act_frac, act_counts)
        self._enter(seq)
        self.state_slots.allocate(seq.seq_id, seq.kv_tier)
        seq.state_restore, seq.state_save = restore, save
        if restore is not None:
            self.page_manager.stats.state_hits += 1
        pages = self.page_manager.start(seq.seq_id, seq.kv_tier, prefix)
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens is None:  # the first admission's hit is the request's
            seq.num_cached_tokens = num_cached
        stats = self.page_manager.stats
        stats.query_tokens += seq.num_tokens
        stats.hit_tokens += num_cached
        return seq, num_new, pages + self.page_manager.append(seq.seq_id, num_new)

    def _admit_fork(self, seq: Sequence, budget: int) -> tuple[Sequence, int, list[PageRef]] | None:
        """A fork into the block on its home tier (its first decode copies the shared partial
        page), if the projected KV fits."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.kv_tier in self.page_manager.paused or not self._kv_fits(seq, num_new, seq.kv_tier):
            return None
        self._enter(seq)
        return seq, num_new, self.page_manager.append(seq.seq_id, num_new)

    def _enter(self, seq: Sequence) -> None:
        """Move seq from its queue into a slot of the block."""
        self.waiting[seq.request.priority].remove(seq)
        seq.slot = heapq.heappop(self._free_slots)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _with_states(
        self, match: list[PageRef], prefix: list[PageRef]
    ) -> tuple[list[PageRef], tuple[str, int] | None, tuple[int, str] | None]:
        """A hybrid's cached prefix: `prefix` cut to its longest part whose end has a saved
        state, that state's snapshot slot, and where to save one if the cached KV `match`
        runs further (a prefix seen twice: the next request with it hits)."""
        cache, page_tokens = self.page_manager.cache, self.config.page_tokens
        usable, restore = 0, None
        for k in range(len(prefix), 0, -1):
            h = cache.hash_of(prefix[k - 1])
            restore = None if h is None else self.snapshots.find(h)
            if restore is not None:
                usable = k
                break
        save = None
        if len(match) > usable:
            h = cache.hash_of(match[-1])
            if h is not None and not self.snapshots.has(h):
                save = (len(match) * page_tokens, h)
        return prefix[:usable], restore, save

    def _until_state_save(self, seq: Sequence, start: int, num_new: int) -> int:
        """A chunk of `num_new` tokens from `start` cut where seq's state is to be saved."""
        if seq.state_save is None:
            return num_new
        return min(num_new, max(0, seq.state_save[0] - start)) or num_new

    def _worth_loading(self, prefix: list[PageRef]) -> list[PageRef]:
        """`prefix` cut before its first page on a tier where a hit this long loses to
        recomputing (SchedulerConfig.min_hit_tokens), or whose storage rests after a fault."""
        num_tokens = len(prefix) * self.config.page_tokens
        for i, (tier, _) in enumerate(prefix):
            too_short = num_tokens < self.config.min_hit_tokens.get(tier, 0)
            if too_short or tier in self.page_manager.paused:
                return prefix[:i]
        return prefix

    def _kv_fits(self, seq: Sequence, num_new: int, tier: str) -> bool:
        """Room now for the first chunk, and projected peak KV on tier within capacity."""
        if not self.page_manager.can_append(seq.seq_id, num_new, tier):
            return False
        capacity = self.page_manager.capacity_pages[tier]
        if capacity is None:
            return True
        if self.page_manager.num_pages_for(seq.num_tokens) > capacity:
            return False  # too long for this pool even alone (it was preempted from it)
        others = [s for s in self.running if s.kv_tier == tier]
        if not others:  # an empty pool always takes one: progress
            return True
        lengths = [(s.num_tokens, self._expected_remaining(s)) for s in [*others, seq]]
        return self.page_manager.projected_peak_pages(lengths) <= capacity

    def _expected_remaining(self, seq: Sequence) -> int:
        """Tokens seq is expected to add before it ends (see expected_gen_tokens)."""
        remaining = min(seq.num_remaining, self.max_len - seq.num_tokens)
        expected_total = self.config.expected_gen_tokens
        if expected_total is None and self._num_finished:
            expected_total = -(-self._finished_gen_tokens // self._num_finished)  # ceil mean
        if expected_total is not None and not self.config.conservative_admission:
            remaining = min(remaining, expected_total - seq.num_generated - seq.num_pending)
        return max(remaining, 0)

    def _release(self, seq: Sequence) -> None:
        """Take seq out of the block: free its KV and slot, tell the engine to forget it."""
        if seq in self.running:
            self.running.remove(seq)
            heapq.heappush(self._free_slots, seq.slot)
        self.page_manager.free(seq.seq_id)
        self.state_slots.free(seq.seq_id)
        if seq.is_sent:
            self._freed_seq_ids.append(seq.seq_id)
        seq.is_sent, seq.slot = False, -1

    def _retire(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted)."""
        self._release(seq)
        queue = self.waiting.get(seq.request.priority)
        if queue is not None and seq in queue:
            queue.remove(seq)
        self._seqs.pop(seq.seq_id, None)
        self._prompt_hashes.pop(seq.seq_id, None)
        group = self._groups.get(seq.request.group or "")
        if group is not None:
            group.remove(seq)
            if not group:
                del self._groups[seq.request.group or ""]

    def _queues(self) -> list[deque[Sequence] | PrefixQueue[Sequence]]:
        return [q for _, q in sorted(self.waiting.items()) if q]

    # -- online before batch, prefix order -------------------------------------------------
    def _next_to_admit(self) -> Sequence | None:
        """The queued sequence to admit next: the head of the first non-empty queue, or with
        prefix ordering its first sequence that `PrefixGate` lets through (a FIFO queue's head
        only, a batch queue's first LOOKAHEAD). A choice whose request's prompt another choice
        is computing waits for its fork (`_forks`) as the gate's prompts wait. None when they
        are all held (nothing of a later queue goes ahead), or a batch line would pass
        `batch_share` of the slots while online work is present."""
        queues = self._queues()
        if not queues:
            return None
        queue = queues[0]
        head = next(iter(queue))
        if head.request.priority >= BATCH_PRIORITY and self._online_present():
            num_batch = sum(1 for s in self.running if s.request.priority >= BATCH_PRIORITY)
            if num_batch >= self._share_of(self.config.block_size):
                return None
        forking = {s.request.group for s in self.running if self._leads_fork(s)}
        if not self.prefix_ordering:
            waits = head.request.group in forking and self._can_fork(head)
            return None if waits else head
        pages = self.page_manager
        in_flight = (
            self._prompt_hashes[s.seq_id][pages.num_indexed_pages(s.seq_id) :] for s in self.running
        )
        gate = PrefixGate(pages.cache, in_flight)
        if isinstance(queue, deque):
            candidates: Iterable[Sequence] = [head]
        else:
            candidates = itertools.islice(queue, LOOKAHEAD)
        for s in candidates:
            if s.seq_id in pages:  # a fork: its KV is held
                return s
            if s.request.group in forking and self._can_fork(s):
                continue
            if not gate.holds(self._prompt_hashes[s.seq_id]):
                return s
        return None

    def _online_present(self) -> bool:
        """Some online request (priority before BATCH_PRIORITY) waits or runs."""
        return any(p < BATCH_PRIORITY and q for p, q in self.waiting.items()) or any(
            s.request.priority < BATCH_PRIORITY for s in self.running
        )

    def _share_of(self, total: int) -> int:
        """batch_share of `total`, rounded up (at least 1 of a positive total)."""
        return -(-total * round(self.config.batch_share * 1000) // 1000)

    def _batch_tokens(self) -> int:
        """Prefill tokens batch work may take this step (batch_share of the step's budget
        while online work is present; the whole budget otherwise)."""
        total = self.config.max_step_tokens
        return self._share_of(total) if self._online_present() else total

    def _prefill_budget(self, seq: Sequence, budget: int) -> int:
        """`budget` capped by what is left of the batch share, for a batch sequence."""
        if seq.request.priority < BATCH_PRIORITY:
            return budget
        return min(budget, self._batch_budget)

    def _spend(self, seq: Sequence, num_prefill: int) -> None:
        if seq.request.priority >= BATCH_PRIORITY:
            self._batch_budget -= num_prefill

    # -- postprocess -------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, result: StepResult) -> list[SequenceDelta]:
        """Apply the sampled tokens; what each request that produced a token gained, in plan
        order (a request's last delta says how it finished). A failed step goes to `recover`."""
        if result.failure is not None:
            return self.recover(plan, result.failure)
        sampled = [c for c in plan.chunks if c.do_sample and c.seq_id not in result.pooled]
        if [c.seq_id for c in sampled] != result.seq_ids or len(result.token_ids) != len(sampled):
            raise EngineProtocolError(
                f"step {plan.step_id}: result seq_ids {result.seq_ids} do not match the plan"
            )
        scored: set[int] = set()  # sequences whose prompt logprobs came with this step
        for seq_id, prompt_logprobs in result.prompt_logprobs.items():
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.prompt_logprobs is None:  # not again after a recompute
                seq.prompt_logprobs = prompt_logprobs
                scored.add(seq_id)
        epochs = self._plan_epochs.pop(plan.step_id, {})
        self.snapshots.commit(plan.step_id)  # the states it saved are in their slots now
        for chunk in plan.chunks:  # their KV is computed now: index the pages they filled
            seq = self._seqs.get(chunk.seq_id)
            if seq is not None and epochs.get(seq.seq_id) == seq.epoch:  # not preempted since
                computed = chunk.start_pos + len(chunk.token_ids)
                self.page_manager.commit(seq.seq_id, seq.cache_token_ids, computed)
        deltas: list[SequenceDelta] = [
            pooled
            for seq_id, output in result.pooled.items()
            if (pooled := self._pooled(seq_id, output)) is not None
        ]
        for chunk, token_id, logprobs in zip(sampled, result.token_ids, result.logprobs):
            seq = self._seqs.get(chunk.seq_id)
            if seq is None:  # finished or aborted after this plan was built: drop the token
                continue
            seq.num_pending -= 1
            error = result.errors.get(seq.seq_id)
            delta: SequenceDelta | None
            if error is not None:
                seq.fail(error)
                delta = seq.report([], "", None)
            else:
                delta = seq.append_token(
                    token_id, logprobs, self.config.eos_token_ids, self.max_len
                )
            if seq.is_finished:
                self._finish(seq)
            if delta is None:  # a final-only request, not finished
                continue
            if seq.seq_id in scored:
                delta.prompt_logprobs = seq.prompt_logprobs
            deltas.append(delta)
        return deltas

    def _pooled(self, seq_id: int, output: list[float]) -> SequenceDelta | None:
        """A pooling request's prompt ran: it ends with its pooled output (None: it was
        finished or aborted after the plan was built)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        seq.num_pending -= 1
        delta = seq.pool(output)
        self._finish(seq)
        return delta

    def _finish(self, seq: Sequence) -> None:
        """Count a finished sequence and remove it and its request for good."""
        self._finished_gen_tokens += seq.num_generated
        self._num_finished += 1
        self._retire(seq)
        del self.requests[seq.request.request_id]

    # -- storage faults ----------------------------------------------------------------
    def is_blocked_by_storage(self) -> bool:
        """No tier that holds a sequence of the longest length (`max_len`) may take KV now:
        requests wait until a paused tier is tried again."""
        resting = self.rest.tiers()
        capacity, page_tokens = self.page_manager.capacity_pages, self.config.page_tokens
        able = [
            t
            for t, f in zip(TIERS, self.config.kv_frac, strict=True)
            if f > 0 and pool_tokens(capacity[t], page_tokens) >= self.max_len - 1
        ]
        return bool(resting) and all(t in resting for t in able)

    def recover(
        self, plan: StepPlan, failure: StepFailure, unrun: StepPlan | None = None
    ) -> list[SequenceDelta]:
        """The executor did not run `plan` to its end (`failure`); `unrun`: the plan built after
        it (asynchronous scheduling), which will not run either. Nothing they did counts: their
        page moves are undone (the copies dropped from the cache), the pages that failed are
        dropped, and their sequences (and any other that holds a failed page or is homed on
        the failed tier) go back to the front of their queues to be recomputed. A failed tier
        takes no new KV for offload_retry_s. A sequence that used the failed tier in
        `max_offload_faults` failed steps ends with a retryable error instead; those last
        deltas are returned."""
        pages = self.page_manager
        plans = [plan] if unrun is None else [plan, unrun]
        for p in plans:
            self._plan_epochs.pop(p.step_id, None)
            self.snapshots.cancel(p.step_id)
            for move in p.page_moves:
                pages.forget_page(move.dst, move.hash)
        if unrun is not None:  # it never reached the executor: its records go with the next
            self._freed_seq_ids[:0] = unrun.freed_seq_ids
            pages.requeue_records(unrun.cached_disk_pages)
        bad = {("disk", page) for page in failure.bad_pages}
        pages.stats.failed_pages += sum(pages.forget_page(ref) for ref in sorted(bad))
        if failure.tier is not None:
            self.rest.fault(failure.tier, failure.message)
            pages.paused = self.rest.tiers()
        involved = {c.seq_id for p in plans for c in p.chunks}
        for seq_id in involved:  # their samples in flight will never come back
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.num_pending = 0
                if not seq.num_generated:  # its first admission's hit did not count
                    seq.num_cached_tokens = None
        first_unrun = [c.seq_id for c in unrun.chunks if c.sampling is not None] if unrun else []
        for seq_id in first_unrun:  # never reached the executor: nothing there to forget
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.is_sent = False
        deltas = []
        forks = [s for s in self._seqs.values() if s.seq_id in pages and s not in self.running]
        for seq in [*reversed(self.running), *forks]:  # newest first: the oldest ends in front
            holds_bad = bool(bad) and any(ref in bad for ref in pages.page_table(seq.seq_id))
            on_tier = failure.tier is not None and seq.kv_tier == failure.tier
            if seq.seq_id not in involved and not holds_bad and not on_tier:
                continue
            if seq not in self.running:  # a fork waiting with its KV: drop it, stay queued
                self._drop_kv(seq)
                continue
            self._requeue(seq)
            if seq.seq_id in failure.seq_ids:
                seq.num_offload_faults += 1
                if seq.num_offload_faults >= self.config.max_offload_faults:
                    deltas.append(self._fail_retryable(seq, failure.message))
        return deltas

    def _fail_retryable(self, seq: Sequence, reason: str) -> SequenceDelta:
        """End seq with an error that is not the request's: its storage failed again."""
        self._retire(seq)
        del self.requests[seq.request.request_id]
        seq.fail(f"the engine's offload storage failed ({reason})", retryable=True)
        return seq.delta([], "", None)
