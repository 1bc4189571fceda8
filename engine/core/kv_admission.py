"""`KvAdmission`: which queued sequence enters the block, on which tier, from which prefix.

Torch-free. A sequence is admitted when its projected peak KV fits some tier (NanoFlow 4.4):
the running sequences of that tier plus it, each expected to add `expected_gen_tokens` (or
the running mean output length of the finished requests) before it ends. A wrong projection
is caught by preemption, never by running out of pages. With prefix caching its longest
cached prefix worth loading is taken instead of recomputed (a hybrid's only up to a saved
state, `StateSnapshots`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.choice_forks import ChoiceForks
from engine.core.kv_pages import PageManager, pick_tier
from engine.core.prefix_cache import PageRef
from engine.core.running_block import RunningBlock
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import Sequence
from engine.core.state_slots import StateSlots, StateSnapshots
from engine.core.tier_rest import TierRest, pool_tokens
from engine.core.wait_queues import WaitQueues
from policy import TIERS


@dataclass(frozen=True, slots=True)
class Admitted:
    """A sequence that entered the block, and its first chunk."""

    seq: Sequence
    num_new: int
    """Tokens its first chunk computes (from `seq.num_computed_tokens`)."""
    pages: list[PageRef]
    """The pages its first chunk brings: the cached prefix's, then those it writes."""


def until_state_save(seq: Sequence, start: int, num_new: int) -> int:
    """A chunk of `num_new` tokens from `start` cut where seq's state is to be saved."""
    if seq.state_save is None:
        return num_new
    return min(num_new, max(0, seq.state_save[0] - start)) or num_new


class KvAdmission:
    """Admits the next queued sequence into the block if its projected KV fits a tier."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        rest: TierRest,
        max_len: int,
        pages: PageManager,
        state_slots: StateSlots,
        snapshots: StateSnapshots,
        queues: WaitQueues,
        forks: ChoiceForks,
        block: RunningBlock,
    ) -> None:
        """The parts it reads and moves sequences between, shared with the `Scheduler`."""
        self.config = config
        self.rest = rest
        """The tiers that rest after a storage fault."""
        self.max_len = max_len
        """Sequences end ('length') at this many tokens (`Scheduler.max_len`)."""
        self.pages, self.state_slots, self.snapshots = pages, state_slots, snapshots
        self.queues, self.forks, self.block = queues, forks, block
        self._finished_gen_tokens = 0  # over requests that ended on their own (stop, length)
        self._num_finished = 0

    def count_finished(self, seq: Sequence) -> None:
        """Add a finished sequence's output length to the running mean (expected_gen_tokens
        None)."""
        self._finished_gen_tokens += seq.num_generated
        self._num_finished += 1

    def is_blocked_by_storage(self) -> bool:
        """No tier that holds a sequence of the longest length (`max_len`) may take KV now:
        requests wait until a paused tier is tried again."""
        resting = self.rest.tiers()
        capacity, page_tokens = self.pages.capacity_pages, self.config.page_tokens
        able = [
            t
            for t, f in zip(TIERS, self.config.kv_frac, strict=True)
            if f > 0 and pool_tokens(capacity[t], page_tokens) >= self.max_len - 1
        ]
        return bool(resting) and all(t in resting for t in able)

    def admit(self, budget: int) -> Admitted | None:
        """Move the next queued sequence into the block if its projected KV fits some tier.
        With prefix caching its longest cached prefix is taken, not recomputed, unless it
        wants its prompt's logprobs (as vLLM does): those need the logits at every prompt
        position, which a cached prefix never computes."""
        seq = self.queues.next_to_admit(self.block.seqs, self.forks, self.pages)
        if seq is None or seq.num_pending:
            return None
        budget = self.queues.prefill_budget(seq, budget)
        if budget == 0:
            return None
        if seq.seq_id in self.pages:  # a fork: it holds its prompt's KV already
            return self._admit_fork(seq, budget)
        prefix: list[PageRef] = []
        restore, save = None, None
        if not seq.wants_prompt_logprobs:  # those need every prompt position's logits
            match = self.pages.match(seq.cache_token_ids)
            prefix = self._worth_loading(match)
            if self.snapshots.enabled:
                prefix, restore, save = self._with_states(match, prefix)
        num_cached = len(prefix) * self.config.page_tokens
        num_new = min(seq.num_tokens - num_cached, budget)
        if save is not None and save[0] < num_cached + num_new:
            num_new = save[0] - num_cached  # the first chunk ends where the state is saved
        num_new = seq.whole_images(num_cached, num_new)
        if num_new == 0:  # it starts at an image the budget cannot take whole: a later step
            return None
        running = self.block.seqs
        counts = {t: 0 for t in TIERS}
        for s in running:
            counts[s.kv_tier] += 1
        paused = self.pages.paused
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
        act_counts = {t: sum(1 for s in running if s.act_tier == t) for t in TIERS}
        seq.act_tier = pick_tier(self.config.act_frac, act_counts)
        self._enter(seq)
        self.state_slots.allocate(seq.seq_id, seq.kv_tier)
        seq.state_restore, seq.state_save = restore, save
        if restore is not None:
            self.pages.stats.state_hits += 1
        pages = self.pages.start(seq.seq_id, seq.kv_tier, prefix)
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens is None:  # the first admission's hit is the request's
            seq.num_cached_tokens = num_cached
        stats = self.pages.stats
        stats.query_tokens += seq.num_tokens
        stats.hit_tokens += num_cached
        return Admitted(seq, num_new, pages + self.pages.append(seq.seq_id, num_new))

    def _admit_fork(self, seq: Sequence, budget: int) -> Admitted | None:
        """A fork into the block on its home tier (its first decode copies the shared partial
        page), if the projected KV fits."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if seq.kv_tier in self.pages.paused or not self._kv_fits(seq, num_new, seq.kv_tier):
            return None
        self._enter(seq)
        return Admitted(seq, num_new, self.pages.append(seq.seq_id, num_new))

    def _enter(self, seq: Sequence) -> None:
        """Move seq from its queue into a slot of the block."""
        self.queues.remove(seq)
        self.block.enter(seq)

    def _with_states(
        self, match: list[PageRef], prefix: list[PageRef]
    ) -> tuple[list[PageRef], tuple[str, int] | None, tuple[int, str] | None]:
        """A hybrid's cached prefix: `prefix` cut to its longest part whose end has a saved
        state, that state's snapshot slot, and where to save one if the cached KV `match`
        runs further (a prefix seen twice: the next request with it hits)."""
        cache, page_tokens = self.pages.cache, self.config.page_tokens
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

    def _worth_loading(self, prefix: list[PageRef]) -> list[PageRef]:
        """`prefix` cut before its first page on a tier where a hit this long loses to
        recomputing (SchedulerConfig.min_hit_tokens), or whose storage rests after a fault."""
        num_tokens = len(prefix) * self.config.page_tokens
        for i, (tier, _) in enumerate(prefix):
            too_short = num_tokens < self.config.min_hit_tokens.get(tier, 0)
            if too_short or tier in self.pages.paused:
                return prefix[:i]
        return prefix

    def _kv_fits(self, seq: Sequence, num_new: int, tier: str) -> bool:
        """Room now for the first chunk, and projected peak KV on tier within capacity."""
        if not self.pages.can_append(seq.seq_id, num_new, tier):
            return False
        capacity = self.pages.capacity_pages[tier]
        if capacity is None:
            return True
        if self.pages.num_pages_for(seq.num_tokens) > capacity:
            return False  # too long for this pool even alone (it was preempted from it)
        others = [s for s in self.block.seqs if s.kv_tier == tier]
        if not others:  # an empty pool always takes one: progress
            return True
        lengths = [(s.num_tokens, self._expected_remaining(s)) for s in [*others, seq]]
        return self.pages.projected_peak_pages(lengths) <= capacity

    def _expected_remaining(self, seq: Sequence) -> int:
        """Tokens seq is expected to add before it ends (see expected_gen_tokens)."""
        remaining = min(seq.num_remaining, self.max_len - seq.num_tokens)
        expected_total = self.config.expected_gen_tokens
        if expected_total is None and self._num_finished:
            expected_total = -(-self._finished_gen_tokens // self._num_finished)  # ceil mean
        if expected_total is not None and not self.config.conservative_admission:
            remaining = min(remaining, expected_total - seq.num_generated - seq.num_pending)
        return max(remaining, 0)
