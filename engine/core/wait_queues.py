"""`WaitQueues`: the sequences waiting for a slot, online before batch, torch-free.

One queue per priority, the lower first (online calls before batch work, NanoFlow 4.4's
priority classes); FIFO within one, or with prefix ordering batch work in the trie order of
its prompts' page hashes (`PrefixQueue`), and a prompt whose next uncached page a running
sequence is computing waits a step to hit it (`PrefixGate`). Preempted and recovered
sequences go back to the front. While online work waits or runs, batch work takes at most
`SchedulerConfig.batch_share` of the block's slots, and its prefill chunks at most that share
of a full block's decode rows a step (`batch_slots` tokens), so the online work's steps stay
short; with `batch_step_cap` batch prefill takes at most batch_share of the step budget in
every step, so the steps ahead of an online request that comes are short too, and they keep
the online share for `LINGER_STEPS` steps after online work left.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from engine.core.choice_forks import ChoiceForks
from engine.core.kv_pages import PageManager
from engine.core.prefix_order import (
    LOOKAHEAD,
    PageHashes,
    PrefixGate,
    PrefixQueue,
    prompt_page_hashes,
)
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import BATCH_PRIORITY, Sequence

Queue = deque[Sequence] | PrefixQueue[Sequence]

LINGER_STEPS = 2
"""With batch_step_cap: steps after online work left in which batch prefill keeps the online
share, so a client's next request, sent once the last is answered, finds short steps ahead."""


class WaitQueues:
    """Queues per priority and the batch share of the step being planned."""

    def __init__(self, config: SchedulerConfig, prefix_ordering: bool) -> None:
        self.config = config
        self.prefix_ordering = prefix_ordering
        """Batch work waits in prefix order (only with prefix caching)."""
        self.queues: dict[int, Queue] = {}
        """Queues per priority (lower first), FIFO (batch work in prefix order with
        prefix_ordering); preempted sequences go back to the front."""
        self._prompt_hashes: dict[int, PageHashes] = {}
        """With prefix_ordering: each unfinished sequence's prompt page hashes."""
        self.batch_budget = config.max_step_tokens
        """Prefill tokens batch work may still take in the step being planned."""
        self._steps_since_online = LINGER_STEPS + 1
        """Steps planned since the last one with online work present."""

    # -- membership ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of its priority's queue (its prefix's place)."""
        if self.prefix_ordering:
            self._prompt_hashes[seq.seq_id] = prompt_page_hashes(
                seq.cache_token_ids, self.config.page_tokens, self.config.cache_salt
            )
        priority = seq.request.priority
        if priority not in self.queues:
            self.queues[priority] = self._new_queue(priority)
        self.queues[priority].append(seq)

    def _new_queue(self, priority: int) -> Queue:
        if self.prefix_ordering and priority >= BATCH_PRIORITY:
            return PrefixQueue(lambda seq: self._prompt_hashes[seq.seq_id])
        return deque()

    def push_front(self, seq: Sequence) -> None:
        """Queue a sequence that ran (preempted, recovered) ahead of its queue."""
        self.queues[seq.request.priority].appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a queued sequence out (it enters the block)."""
        self.queues[seq.request.priority].remove(seq)

    def forget(self, seq: Sequence) -> None:
        """Drop a sequence for good (finished or aborted), queued or not."""
        queue = self.queues.get(seq.request.priority)
        if queue is not None and seq in queue:
            queue.remove(seq)
        self._prompt_hashes.pop(seq.seq_id, None)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def in_order(self) -> list[Queue]:
        """The non-empty queues, the first to admit from first."""
        return [q for _, q in sorted(self.queues.items()) if q]

    def class_lengths(self, running: list[Sequence]) -> dict[str, tuple[int, int]]:
        """(waiting, running) sequences of the online and the batch class."""
        counts = {"online": [0, 0], "batch": [0, 0]}
        for priority, queue in self.queues.items():
            counts["batch" if priority >= BATCH_PRIORITY else "online"][0] += len(queue)
        for seq in running:
            counts["batch" if seq.request.priority >= BATCH_PRIORITY else "online"][1] += 1
        return {name: (waiting, running) for name, (waiting, running) in counts.items()}

    # -- online before batch, prefix order -------------------------------------------------
    def next_to_admit(
        self, running: list[Sequence], forks: ChoiceForks, pages: PageManager
    ) -> Sequence | None:
        """The queued sequence to admit next: the head of the first non-empty queue, or with
        prefix ordering its first sequence that `PrefixGate` lets through (a FIFO queue's head
        only, a batch queue's first LOOKAHEAD). A choice whose request's prompt another choice
        is computing waits for its fork (`ChoiceForks`) as the gate's prompts wait. None when
        they are all held (nothing of a later queue goes ahead), or a batch line would pass
        `batch_share` of the slots while online work is present."""
        queues = self.in_order()
        if not queues:
            return None
        queue = queues[0]
        head = next(iter(queue))
        if head.request.priority >= BATCH_PRIORITY and self.online_present(running):
            num_batch = sum(1 for s in running if s.request.priority >= BATCH_PRIORITY)
            if num_batch >= self.batch_slots:
                return None
        forking = forks.leading_groups(running)
        if not self.prefix_ordering:
            waits = head.request.group in forking and forks.can_fork(head)
            return None if waits else head
        in_flight = (
            self._prompt_hashes[s.seq_id][pages.num_indexed_pages(s.seq_id) :] for s in running
        )
        gate = PrefixGate(pages.cache, in_flight)
        if isinstance(queue, deque):
            candidates: Iterable[Sequence] = [head]
        else:
            candidates = itertools.islice(queue, LOOKAHEAD)
        for s in candidates:
            if s.seq_id in pages:  # a fork: its KV is held
                return s
            if s.request.group in forking and forks.can_fork(s):
                continue
            if not gate.holds(self._prompt_hashes[s.seq_id]):
                return s
        return None

    @property
    def num_online_waiting(self) -> int:
        """Online sequences (priority before BATCH_PRIORITY) waiting for a slot."""
        return sum(len(q) for p, q in self.queues.items() if p < BATCH_PRIORITY)

    @property
    def batch_slots(self) -> int:
        """While online work is present: the most slots batch lines hold, and the most
        prefill tokens batch chunks take a step (batch_share of the block, rounded up)."""
        return self._share_of(self.config.block_size)

    def online_present(self, running: list[Sequence]) -> bool:
        """Some online request (priority before BATCH_PRIORITY) waits or runs."""
        return any(p < BATCH_PRIORITY and q for p, q in self.queues.items()) or any(
            s.request.priority < BATCH_PRIORITY for s in running
        )

    def _share_of(self, total: int) -> int:
        """batch_share of `total`, rounded up (at least 1 of a positive total)."""
        return -(-total * round(self.config.batch_share * 1000) // 1000)

    def start_step(self, running: list[Sequence]) -> None:
        """Set the prefill tokens batch work may take in the step planned now: while online
        work is present `batch_slots`, so a step the online work is in runs at most
        batch_share more rows than a full block's decodes (on a CPU every row costs: a step
        filled with batch prefill would multiply each of its tokens' time), and with
        batch_step_cap for LINGER_STEPS more steps after it left (planned ahead of a client's
        next request); otherwise `batch_step_tokens`."""
        online = self.online_present(running)
        self._steps_since_online = 0 if online else self._steps_since_online + 1
        lingers = self.config.batch_step_cap and self._steps_since_online <= LINGER_STEPS
        self.batch_budget = self.batch_slots if online or lingers else self.batch_step_tokens

    @property
    def batch_step_tokens(self) -> int:
        """The most prefill tokens batch work takes in a step without online work: batch_share
        of max_step_tokens with `batch_step_cap` (an online request that comes finds the
        step in flight and the one planned ahead short), else the whole budget."""
        if self.config.batch_step_cap:
            return self._share_of(self.config.max_step_tokens)
        return self.config.max_step_tokens

    def prefill_budget(self, seq: Sequence, budget: int) -> int:
        """`budget` capped by what is left of the batch share, for a batch sequence."""
        if seq.request.priority < BATCH_PRIORITY:
            return budget
        return min(budget, self.batch_budget)

    def spend(self, seq: Sequence, num_prefill: int) -> None:
        """Count a batch sequence's prefill tokens against the step's batch share."""
        if seq.request.priority >= BATCH_PRIORITY:
            self.batch_budget -= num_prefill
