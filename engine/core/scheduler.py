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

The parts, each its own module: the waiting queues, online before batch and in prefix order
(`WaitQueues`), the running block's slots (`RunningBlock`), admission by projected KV
(`KvAdmission`), the n-choice forks (`ChoiceForks`), the checks a request must pass
(`check_request`) and the settings (`SchedulerConfig`).
"""

from __future__ import annotations

import itertools

from engine.core.choice_forks import ChoiceForks
from engine.core.detokenizer import Detokenizer
from engine.core.kv_admission import KvAdmission, until_state_save
from engine.core.kv_pages import PageManager
from engine.core.outputs import SequenceDelta
from engine.core.prefix_cache import PageRef
from engine.core.protocol import PENDING_TOKEN_ID, SeqChunk, StepFailure, StepPlan, StepResult
from engine.core.request_checks import check_request
from engine.core.running_block import RunningBlock
from engine.core.scheduler_config import SchedulerConfig, pick_size
from engine.core.sequence import BATCH_PRIORITY, Request, Sequence, SequenceStatus
from engine.core.state_slots import StateSlots, StateSnapshots
from engine.core.tier_rest import TierRest, largest_pool_tokens
from engine.core.wait_queues import WaitQueues


class EngineProtocolError(RuntimeError):
    """A StepResult that does not answer its StepPlan (a bug in the executor)."""


class Scheduler:
    """Decides what every step runs; owns the queues, the KV page tables and the slots.

    Not thread-safe: one driver (StepLoop) calls it. Contract per step:
    `plan = schedule()`, run it, `postprocess(plan, result)`. Asynchronous
    drivers may call `schedule()` once more before the previous postprocess.
    """

    def __init__(self, config: SchedulerConfig, detokenizer: Detokenizer | None = None) -> None:
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
        prefix_ordering = config.prefix_ordering and self.page_manager.prefix_caching
        self.waiting = WaitQueues(config, prefix_ordering)
        """The sequences waiting for a slot, online before batch."""
        self.forks = ChoiceForks(self.page_manager, enabled=caching and not hybrid)
        """The n choices of a request share one prefill (a hybrid's state is not forked)."""
        self.block = RunningBlock(config.block_size)
        self.requests: dict[str, Sequence] = {}
        self._seqs: dict[int, Sequence] = {}
        self._freed_seq_ids: list[int] = []
        self.num_preemptions = 0
        """Sequences preempted so far (their KV dropped, to be recomputed)."""
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
        self.rest = TierRest(config.offload_retry_s)
        """The tiers that rest after a storage fault (read from the daemon's event loop too)."""
        self.admission = KvAdmission(
            config,
            rest=self.rest,
            max_len=self.max_len,
            pages=self.page_manager,
            state_slots=self.state_slots,
            snapshots=self.snapshots,
            queues=self.waiting,
            forks=self.forks,
            block=self.block,
        )
        self.config = config

    @property
    def config(self) -> SchedulerConfig:
        """The settings; replacing them (tests tune admission so) reaches every part."""
        return self._config

    @config.setter
    def config(self, config: SchedulerConfig) -> None:
        self._config = self.waiting.config = self.admission.config = config

    @property
    def running(self) -> list[Sequence]:
        """The running sequences in admission order: the last one is the newest (the first
        to preempt)."""
        return self.block.seqs

    # -- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestError for one that can never run."""
        check_request(
            request,
            self.config.max_model_len,
            self.kv_tokens,
            self.requests,
            self.config.max_step_tokens,
        )
        seq = Sequence.from_request(request, self._next_seq_id, self.detokenizer)
        self._next_seq_id += 1
        self.requests[request.request_id] = seq
        self._seqs[seq.seq_id] = seq
        self.forks.join(seq)
        self.waiting.add(seq)

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
        return len(self.waiting)

    def queue_lengths(self) -> dict[str, tuple[int, int]]:
        """(waiting, running) sequences of the online and the batch class."""
        return self.waiting.class_lengths(self.running)

    # -- schedule ----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run now."""
        self.page_manager.paused = self.rest.tiers()
        if not self.config.static_blocks:
            self._free_slots_for_online()
        live = [s for s in self.running if not s.will_finish(self.max_len)]
        num_decodes = sum(1 for s in live if s.num_tokens - s.num_computed_tokens == 1)
        demand = sum(s.num_tokens - s.num_computed_tokens for s in live)
        can_admit = not self.config.static_blocks or not self.running
        num_joining = self.block.num_free_slots if can_admit else 0
        queued = itertools.islice(itertools.chain(*self.waiting.in_order()), num_joining)
        demand += sum(s.num_tokens - s.num_computed_tokens for s in queued)
        step_tokens = self._pick_size(demand) if self.config.discrete_batching else None
        budget = (step_tokens or self.config.max_step_tokens) - num_decodes  # prefill tokens

        planned: list[tuple[int, SeqChunk]] = []
        preempted = False
        self.waiting.start_step(self.running)
        for seq in live:  # oldest first; victims are always newer or seq itself
            if seq.status is not SequenceStatus.RUNNING:
                continue
            to_run = seq.num_tokens - seq.num_computed_tokens
            num_new = 1 if to_run == 1 else min(to_run, self.waiting.prefill_budget(seq, budget))
            num_new = until_state_save(seq, seq.num_computed_tokens, num_new)
            num_new = seq.whole_images(seq.num_computed_tokens, num_new)
            if num_new == 0:
                continue
            page_ids = self._allocate(seq, num_new)
            if page_ids is None:
                preempted = True
                continue
            budget -= num_new if to_run > 1 else 0
            self.waiting.spend(seq, num_new if to_run > 1 else 0)
            planned.append((seq.slot, self._chunk(seq, num_new, page_ids)))
        if not planned:  # the budget reserved for preempted decodes is free again
            budget = self.config.max_step_tokens
        can_admit = can_admit or not self.running  # preemption may have emptied the block
        while (
            can_admit
            and (not preempted or not planned)
            and budget > 0
            and self.block.num_free_slots
        ):
            admitted = self.admission.admit(budget)
            if admitted is None:
                break
            seq, num_new = admitted.seq, admitted.num_new
            budget -= num_new
            self.waiting.spend(seq, num_new)
            planned.append((seq.slot, self._chunk(seq, num_new, admitted.pages)))
        if not planned:
            return self._records_plan()
        chunks = [chunk for _, chunk in sorted(planned, key=lambda p: p[0])]
        chunks += [f for c in chunks for f in self.forks.forks_of(self._seqs[c.seq_id], c)]
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

    # -- KV: allocation, preemption --------------------------------------------------------
    def _allocate(self, seq: Sequence, num_new: int) -> list[PageRef] | None:
        """Pages for seq's next tokens, preempting newer ones on its tier; None if seq went."""
        while not self.page_manager.can_append(seq.seq_id, num_new):
            victim = next(s for s in reversed(self.running) if s.kv_tier == seq.kv_tier)
            self._preempt(victim)
            if victim is seq:
                return None
        return self.page_manager.append(seq.seq_id, num_new)

    def _free_slots_for_online(self) -> None:
        """Online work waits for slots the block lacks while batch lines hold more than their
        share (`WaitQueues.batch_slots`): preempt the newest batch lines, one for each such
        online sequence, so it enters this step instead of when a line ends. A preempted line
        keeps the tokens it generated and recomputes its KV when readmitted (its full pages
        likely from the prefix cache): nothing it produced is lost."""
        num_short = self.waiting.num_online_waiting - self.block.num_free_slots
        if num_short <= 0:
            return
        batch = [s for s in self.running if s.request.priority >= BATCH_PRIORITY]
        num_over = len(batch) - self.waiting.batch_slots
        for victim in batch[::-1][: min(num_short, num_over)]:
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's KV and queue it at the front of its queue, to be recomputed later."""
        self.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        seq.state_restore = seq.state_save = None  # looked up again when readmitted
        self.waiting.push_front(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free seq's KV and slot: nothing a plan built before did for it counts (its epoch),
        and it computes its tokens again from the first."""
        seq.epoch += 1
        self._release(seq)
        seq.num_computed_tokens = 0

    def _release(self, seq: Sequence) -> None:
        """Take seq out of the block: free its KV and slot, tell the engine to forget it."""
        self.block.leave(seq)
        self.page_manager.free(seq.seq_id)
        self.state_slots.free(seq.seq_id)
        if seq.is_sent:
            self._freed_seq_ids.append(seq.seq_id)
        seq.is_sent, seq.slot = False, -1

    def _retire(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted)."""
        self._release(seq)
        self.waiting.forget(seq)
        self._seqs.pop(seq.seq_id, None)
        self.forks.leave(seq)

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
        self.admission.count_finished(seq)
        self._retire(seq)
        del self.requests[seq.request.request_id]

    # -- storage faults ----------------------------------------------------------------
    def is_blocked_by_storage(self) -> bool:
        """No tier that holds a sequence of the longest length may take KV now (read from
        the daemon's event loop too): requests wait until a paused tier is tried again."""
        return self.admission.is_blocked_by_storage()

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
