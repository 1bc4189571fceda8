"""`PageManager`: paged KV bookkeeping, a page table per sequence on tier pools (torch-free).

Words: a *page* is `page_tokens` tokens of one sequence's KV (all layers); a *block* is
FlexGen's num_gpu_batches x gpu_batch_size sequences, never a KV unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.prefix_cache import PageRef, PrefixCache, page_hashes
from policy import TIERS


class KVCapacityError(RuntimeError):
    """A tier's KV pool has no free page left."""


@dataclass(frozen=True, slots=True)
class PageMove:
    """Copy one page's KV, every layer, from `src` to `dst` before the step uses either: a
    cached page spilled down a tier, or loaded back up for a sequence that hit it."""

    src: PageRef
    dst: PageRef
    hash: str
    """The content hash of the page (the disk tier's persistent index records it)."""


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy-on-write: before the step, copy page `src` (every layer) into `dst`, which takes
    its place as page `index` of sequence `seq_id`'s page table. A partial last page that
    forked choices share (`PageManager.fork`) is copied by each holder that writes into it
    while others still hold it; `src` stays with them."""

    seq_id: int
    index: int
    src: PageRef
    dst: PageRef


@dataclass(slots=True)
class SeqPages:
    """The pages one sequence holds, in token order (token t in pages[t // page_tokens])."""

    tier: str
    """Home tier: where its own new pages are made."""
    pages: list[PageRef] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[str] = field(default_factory=list)
    """Content hashes of its first len(hashes) pages, known once those pages are computed."""


@dataclass(slots=True)
class CacheStats:
    """Cumulative prefix-cache figures (the daemon's /metrics)."""

    query_tokens: int = 0
    """Prompt tokens looked up."""
    hit_tokens: int = 0
    """Prompt tokens found cached (not recomputed)."""
    hit_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Cached pages found, by the tier they were found on."""
    spilled_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Pages moved down into each tier."""
    loaded_pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Pages loaded back up from each tier for a hit."""
    evicted_pages: int = 0
    """Cached pages dropped (from the last tier with room to spare)."""
    state_hits: int = 0
    """A hybrid's admissions that started from a saved state (`StateSnapshots`)."""
    state_saves: int = 0
    """A hybrid's states saved at the end of a shared prefix."""
    state_evictions: int = 0
    """A hybrid's saved states dropped for room (least recently used)."""
    failed_pages: int = 0
    """Cached pages dropped because they failed verification or could not be read when used
    (a miss: their tokens recomputed)."""


class PageManager:
    """Allocates fixed-size KV pages from one pool per tier, with an optional prefix cache.

    `capacity_pages[tier]` bounds each pool (None: unbounded, the pool grows). A sequence's
    own pages live on its home tier; with prefix caching it may also hold cached pages of
    other sequences (reference counted, never written). A finished sequence's full pages
    stay cached; when a tier needs room, its least recently used unheld pages move down a
    tier (gpu -> cpu -> disk, as `PageMove`s for the next plan) and are dropped only where
    no lower tier has room (NanoFlow 4.4, 5.4).
    """

    def __init__(
        self,
        page_tokens: int,
        capacity_pages: dict[str, int | None],
        *,
        prefix_caching: bool = False,
        salt: str = "",
        max_cached_pages: dict[str, int] | None = None,
    ) -> None:
        assert page_tokens > 0
        self.page_tokens = page_tokens
        self.capacity_pages = {tier: capacity_pages.get(tier) for tier in TIERS}
        self.prefix_caching, self.salt = prefix_caching, salt
        self.max_cached_pages = dict(max_cached_pages or {})
        """Per tier, the most unheld cached pages kept (the disk cache's size bound)."""
        self.cache = PrefixCache()
        self.stats = CacheStats()
        self._free: dict[str, list[int]] = {tier: [] for tier in TIERS}
        self._next_id: dict[str, int] = {tier: 0 for tier in TIERS}
        self._refs: dict[PageRef, int] = {}
        self._held = dict.fromkeys(TIERS, 0)
        self._seqs: dict[int, SeqPages] = {}
        self._moves: list[PageMove] = []
        self._copies: list[PageCopy] = []
        self._disk_cached: list[tuple[int, str]] = []
        self._disk_hits: list[tuple[int, str]] = []
        self.paused: set[str] = set()
        """Tiers that take no new pages for now (their storage failed): nothing spills there."""

    # -- sizes -----------------------------------------------------------------------------

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def num_free_pages(self, tier: str) -> int | None:
        """Pages a sequence could still get on `tier` (free, never used, or cached and
        unheld, which can be spilled or dropped); None when unbounded."""
        cap = self.capacity_pages[tier]
        return None if cap is None else cap - self._held[tier]

    def num_used_pages(self, tier: str) -> int:
        """Pages some sequence holds."""
        return self._held[tier]

    def num_cached_pages(self, tier: str) -> int:
        """Cached pages nobody holds (kept for later hits)."""
        return len(self.cache.lru[tier])

    def projected_peak_pages(self, lengths: list[tuple[int, int]]) -> int:
        """Upper bound on the most pages a set of sequences will hold at once.

        `lengths` holds (num_tokens now, num_tokens still to come) per sequence.
        Each sequence grows one token per step and frees everything when it ends,
        so the peak lies at the step just before one of them ends (NanoFlow 4.4).
        At step t the live ones hold sum(ceil((now + t) / B)) pages (B = page_tokens), bounded
        by (tokens + live * (B - 1)) // B. O(n log n).
        """
        peak = 0
        tokens_now = 0
        for num_live, (now, to_come) in enumerate(sorted(lengths, key=lambda x: -x[1]), 1):
            tokens_now += now
            tokens = tokens_now + num_live * to_come
            peak = max(peak, (tokens + num_live * (self.page_tokens - 1)) // self.page_tokens)
        return peak

    # -- the prefix cache ------------------------------------------------------------------

    def match(self, token_ids: list[int]) -> list[PageRef]:
        """The cached pages of the longest prefix of `token_ids` made of full pages, leaving
        at least one token to compute (its logits are needed). Nothing is taken yet."""
        if not self.prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.page_tokens
        hashes = page_hashes(token_ids[: usable * self.page_tokens], self.page_tokens, self.salt)
        return self.cache.lookup(hashes)

    def start(self, seq_id: int, tier: str, prefix: list[PageRef]) -> list[PageRef]:
        """Begin sequence `seq_id` on home `tier` holding the cached pages `prefix` (from
        `match`). An unheld page below the home tier is loaded back up (a PageMove) when
        the home tier has room; otherwise it is used where it is. Returns its pages."""
        if tier not in TIERS:
            raise ValueError(f"new sequence {seq_id} needs a tier, got {tier!r}")
        seq = self._seqs[seq_id] = SeqPages(tier)
        for ref in prefix:
            h = self.cache.hash_of(ref)
            assert h is not None, f"{ref} is not cached"
            self.stats.hit_pages[ref[0]] += 1
            if _below(ref[0], tier) and self._refs.get(ref, 0) == 0 and self._can_take(tier):
                self.cache.acquire(ref)  # not evictable while it is being moved up
                dst = (tier, self._take(tier, protect=ref))
                self._moves.append(PageMove(ref, dst, self.cache.move(ref, dst)))
                self.stats.loaded_pages[ref[0]] += 1
                self._return(ref)
                ref = dst
            elif ref[0] == "disk":  # read where it is: verified before the step reads it
                self._disk_hits.append((ref[1], h))
            self._hold(ref)
            seq.pages.append(ref)
            seq.hashes.append(h)
        seq.num_tokens = len(prefix) * self.page_tokens
        return list(seq.pages)

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """The first `num_computed` tokens of the sequence (`token_ids`) have their KV: index
        its pages that are now full, so later requests can hit them."""
        seq = self._seqs.get(seq_id)
        if seq is None or not self.prefix_caching:
            return
        parent = seq.hashes[-1] if seq.hashes else ""
        start = len(seq.hashes)
        full = token_ids[: min(num_computed, seq.num_tokens)]
        for i, h in enumerate(page_hashes(full, self.page_tokens, self.salt, parent, start)):
            seq.hashes.append(h)
            ref = seq.pages[start + i]
            if self.cache.add(ref, h) and ref[0] == "disk":  # the same content may exist
                self._disk_cached.append((ref[1], h))

    @property
    def has_unsent_records(self) -> bool:
        """Pages newly cached on disk that `take_moves` has not handed out yet."""
        return bool(self._disk_cached)

    def take_moves(self) -> tuple[list[PageMove], list[tuple[int, str]]]:
        """The page moves decided since the last call, in the order they must run, and the
        (disk page, hash) pairs newly cached on disk."""
        moves, self._moves = self._moves, []
        return moves, self.take_cached_disk_pages()

    def take_cached_disk_pages(self) -> list[tuple[int, str]]:
        """The (disk page, hash) pairs newly cached on disk since the last take."""
        cached, self._disk_cached = self._disk_cached, []
        return cached

    def take_disk_hits(self) -> list[tuple[int, str]]:
        """The (disk page, hash) of cached disk pages sequences started to read in place
        since the last take (`StepPlan.disk_hits`)."""
        hits, self._disk_hits = self._disk_hits, []
        return hits

    def requeue_records(self, cached: list[tuple[int, str]]) -> None:
        """Records a plan that never ran carried: hand them out again (the pages still cached
        under the same hash)."""
        self._disk_cached[:0] = [
            (page, h) for page, h in cached if self.cache.hash_of(("disk", page)) == h
        ]

    def forget_page(self, ref: PageRef, h: str | None = None) -> bool:
        """The cached contents of `ref` cannot be trusted (a move that did not happen, a page
        that failed verification): take it out of the cache (only if it is still cached as
        `h`, when given). An unheld page becomes free; a held one is freed as any uncached
        page once its holders are gone. True if it was cached."""
        cached = self.cache.hash_of(ref)
        if cached is None or (h is not None and cached != h):
            return False
        self.cache.remove(ref)
        if ref not in self._refs:
            self._free[ref[0]].append(ref[1])
        return True

    def preload(self, tier: str, entries: list[tuple[str, int]]) -> None:
        """Cached pages that already exist on `tier` (the disk cache of an earlier run):
        (hash, page id) pairs, indexed as unheld cached pages."""
        for h, page_id in entries:
            ref = (tier, page_id)
            if self.cache.add(ref, h):
                self.cache.release(ref)
                self._next_id[tier] = max(self._next_id[tier], page_id + 1)
        self._free[tier] = [
            p for p in range(self._next_id[tier]) if self.cache.hash_of((tier, p)) is None
        ][::-1]
        self._trim(tier)

    # -- allocation ------------------------------------------------------------------------

    def can_append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> bool:
        """Would `append` succeed for this sequence (or a new one on `tier`)?"""
        seq = self._seqs.get(seq_id)
        home = seq.tier if seq else tier
        assert home is not None
        have = len(seq.pages) if seq else 0
        used = seq.num_tokens if seq else 0
        need = self.num_pages_for(used + num_new_tokens) - have
        if seq is not None and num_new_tokens and self._shared_tail(seq):
            need += 1  # its copy of the shared partial page
        free = self.num_free_pages(home)
        return free is None or need <= free

    def append(self, seq_id: int, num_new_tokens: int, tier: str | None = None) -> list[PageRef]:
        """Reserve room for `num_new_tokens` more tokens; returns the pages added."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self.start(seq_id, tier or "", [])
            seq = self._seqs[seq_id]
        need = self.num_pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages)
        if not self.can_append(seq_id, num_new_tokens):
            raise KVCapacityError(
                f"KV pool on {seq.tier} is full: sequence {seq_id} needs {need} more page(s)"
            )
        if num_new_tokens and self._shared_tail(seq):
            self._copy_tail(seq_id, seq)
        new_pages = [(seq.tier, self._take(seq.tier)) for _ in range(need)]
        for ref in new_pages:
            self._hold(ref)
        seq.pages.extend(new_pages)
        seq.num_tokens += num_new_tokens
        return new_pages

    def fork(self, parent_id: int, child_id: int) -> list[PageRef]:
        """Sequence `child_id` starts holding every page of `parent_id` (another choice of the
        same prompt, its KV computed once), on the same home tier; a partial last page is
        shared until one of them writes into it (`PageCopy`). Returns the child's pages."""
        parent = self._seqs[parent_id]
        assert child_id not in self._seqs, f"sequence {child_id} already holds pages"
        for ref in parent.pages:
            self._hold(ref)
        child = SeqPages(parent.tier, list(parent.pages), parent.num_tokens, list(parent.hashes))
        self._seqs[child_id] = child
        return list(child.pages)

    def take_copies(self) -> list[PageCopy]:
        """The copy-on-write copies decided since the last call, in order (they run after
        the plan's page moves, which may free the pages they fill)."""
        copies, self._copies = self._copies, []
        return copies

    def free(self, seq_id: int) -> None:
        """The sequence is gone: its pages go back, cached ones stay in the LRU."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for ref in reversed(seq.pages):
            self._drop(ref)

    def num_indexed_pages(self, seq_id: int) -> int:
        """Full pages of the sequence indexed in the prefix cache (its own or hits)."""
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else len(seq.hashes)

    def page_table(self, seq_id: int) -> list[PageRef]:
        return list(self._seqs[seq_id].pages)

    def tier_of(self, seq_id: int) -> str:
        return self._seqs[seq_id].tier

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # -- pages -----------------------------------------------------------------------------

    def _hold(self, ref: PageRef) -> None:
        count = self._refs.get(ref, 0)
        if count == 0:
            self._held[ref[0]] += 1
            self.cache.acquire(ref)
        self._refs[ref] = count + 1

    def _drop(self, ref: PageRef) -> None:
        """One holder less; a page nobody holds goes back (a cached one to the LRU)."""
        self._refs[ref] -= 1
        if self._refs[ref] == 0:
            del self._refs[ref]
            self._held[ref[0]] -= 1
            if self.cache.hash_of(ref) is not None:
                self.cache.release(ref)
                self._trim(ref[0])
            else:
                self._free[ref[0]].append(ref[1])

    def _shared_tail(self, seq: SeqPages) -> bool:
        """Its last page is partial and someone else holds it too (a forked choice): the
        next token it writes goes into its own copy."""
        return seq.num_tokens % self.page_tokens != 0 and self._refs[seq.pages[-1]] > 1

    def _copy_tail(self, seq_id: int, seq: SeqPages) -> None:
        src = seq.pages[-1]
        dst = (seq.tier, self._take(seq.tier))
        self._hold(dst)
        self._drop(src)  # others still hold it: it stays
        seq.pages[-1] = dst
        self._copies.append(PageCopy(seq_id, len(seq.pages) - 1, src, dst))

    def _return(self, ref: PageRef) -> None:
        """An unheld page whose contents moved away: free for reuse."""
        self.cache.remove(ref)
        self._free[ref[0]].append(ref[1])

    def _can_take(self, tier: str) -> bool:
        free = self.num_free_pages(tier)
        return free is None or free > 0

    def _take(self, tier: str, protect: PageRef | None = None) -> int:
        """A page id on `tier` for new contents: free, never used, or the least recently used
        unheld cached page, spilled down a tier (or dropped) first."""
        if self._free[tier]:
            return self._free[tier].pop()
        cap = self.capacity_pages[tier]
        if cap is None or self._next_id[tier] < cap:
            page_id = self._next_id[tier]
            self._next_id[tier] += 1
            return page_id
        victim = self.cache.oldest(tier)
        if victim is None or (tier, victim) == protect:
            raise KVCapacityError(f"KV pool on {tier} is full and holds no evictable page")
        self._evict((tier, victim))
        return self._free[tier].pop()

    def _evict(self, ref: PageRef) -> None:
        """Make the unheld cached page `ref` free: spill it to the next tier down that has
        room, else drop it from the cache."""
        lower = next((t for t in TIERS if _below(t, ref[0]) and self._has_room(t)), None)
        if lower is None:
            self.cache.remove(ref)
            self.stats.evicted_pages += 1
        else:
            self.cache.acquire(ref)
            dst = (lower, self._take(lower))
            self._moves.append(PageMove(ref, dst, self.cache.move(ref, dst)))
            self.cache.release(dst)
            self.stats.spilled_pages[lower] += 1
            self._trim(lower)
        self._free[ref[0]].append(ref[1])

    def _has_room(self, tier: str) -> bool:
        """Can `tier` take one more page (possibly by spilling or dropping its own LRU)?"""
        cap = self.capacity_pages[tier]
        if cap == 0 or tier in self.paused:
            return False
        return self._can_take(tier) or self.cache.oldest(tier) is not None

    def _trim(self, tier: str) -> None:
        """Keep at most max_cached_pages[tier] unheld cached pages on `tier`."""
        limit = self.max_cached_pages.get(tier)
        while limit is not None and self.num_cached_pages(tier) > limit:
            victim = self.cache.oldest(tier)
            assert victim is not None
            self._evict((tier, victim))


def _below(tier: str, other: str) -> bool:
    """`tier` is a lower (slower) tier than `other`."""
    return TIERS.index(tier) > TIERS.index(other)


def pick_tier(fracs: tuple[float, float, float], counts: dict[str, int]) -> str:
    """The tier whose share of homed sequences lies furthest below its target fraction.

    Applied to every new sequence, it keeps the realized split as close to
    `fracs` as whole sequences allow (FlexGen splits KV by sequence the same way).
    """
    total = sum(counts.values()) + 1
    best, best_gap = TIERS[0], float("-inf")
    for tier, frac in zip(TIERS, fracs, strict=True):
        if frac <= 0.0:
            continue
        gap = frac * total - counts.get(tier, 0)
        if gap > best_gap + 1e-12:
            best, best_gap = tier, gap
    return best
