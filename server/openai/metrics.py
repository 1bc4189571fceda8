"""`Metrics`: the daemon's Prometheus series, one `CollectorRegistry` per app."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.runtime.engine_client import EngineClient, StepStats
from policy import TIERS

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Follower:
    """Feeds Prometheus counters from the engine's cumulative figures, which start again
    from 0 when the engine restarts: a figure below the last one seen is a fresh count."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], int] = {}

    def __call__(self, counter: Counter, value: int, tier: str = "") -> None:
        key = (id(counter), tier)
        last = self._seen.get(key, 0)
        gained = value - last if value >= last else value
        if gained:
            (counter.labels(tier=tier) if tier else counter).inc(gained)
        self._seen[key] = value


class Metrics:
    """Request-side series fed by the daemon, step-side series fed by the engine's listener."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_waiting = Gauge(
            "nanoflex_requests_waiting", "Requests queued in the scheduler.", registry=r
        )
        self.requests_running = Gauge(
            "nanoflex_requests_running", "Requests in the running block.", registry=r
        )
        self.queue_waiting = Gauge(
            "nanoflex_queue_waiting",
            "Sequences queued in the scheduler, per class (online requests, batch work).",
            ["queue"],
            registry=r,
        )
        self.queue_running = Gauge(
            "nanoflex_queue_running",
            "Sequences in the running block, per class (online requests, batch work).",
            ["queue"],
            registry=r,
        )
        self.online_in_flight = Gauge(
            "nanoflex_online_requests_in_flight",
            "Sequences (prompts x n) of online requests admitted and not finished "
            "(bounded by --max-queue).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "nanoflex_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "nanoflex_generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.requests_finished = Counter(
            "nanoflex_requests_finished",
            "Engine requests that ended, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "nanoflex_requests_rejected",
            "Requests refused (every 4xx answer), by reason: the error's code (queue_full, "
            "invalid_value, unrecognized_argument, ...).",
            ["reason"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "nanoflex_step_seconds", "Engine step time.", buckets=STEP_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "nanoflex_batch_size", "Sequences per engine step.", buckets=BATCH_BUCKETS, registry=r
        )
        self.preemptions = Counter(
            "nanoflex_preemptions",
            "Sequences preempted: their KV dropped when the admission estimate proved wrong, "
            "recomputed later.",
            registry=r,
        )
        self.cache_queries = Counter(
            "nanoflex_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.cache_hits = Counter(
            "nanoflex_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV reused, not computed).",
            registry=r,
        )
        self.state_hits = Counter(
            "nanoflex_prefix_cache_state_hits",
            "Hybrid models: requests that started from a saved state at the end of a cached "
            "prefix.",
            registry=r,
        )
        self.state_saves = Counter(
            "nanoflex_prefix_cache_state_saves",
            "Hybrid models: states saved at the end of a shared prefix.",
            registry=r,
        )
        self.cache_hit_pages = Counter(
            "nanoflex_prefix_cache_hit_pages",
            "Cached KV pages reused, by the tier they were found on.",
            ["tier"],
            registry=r,
        )
        self.cached_pages = Gauge(
            "nanoflex_kv_cached_pages",
            "KV pages kept cached for later hits (held by no request), per tier.",
            ["tier"],
            registry=r,
        )
        self.spilled_bytes = Counter(
            "nanoflex_kv_spilled_bytes",
            "Bytes of cached KV moved down into a tier (LRU spill: gpu -> cpu -> disk).",
            ["tier"],
            registry=r,
        )
        self.loaded_bytes = Counter(
            "nanoflex_kv_loaded_bytes",
            "Bytes of cached KV loaded back up from a tier for a hit.",
            ["tier"],
            registry=r,
        )
        self.evicted_pages = Counter(
            "nanoflex_kv_evicted_pages",
            "Cached KV pages dropped from the last tier with room (LRU).",
            registry=r,
        )
        self.used_pages = Gauge(
            "nanoflex_kv_used_pages",
            "KV pages held by running requests, per tier (0 when idle; more is a leak).",
            ["tier"],
            registry=r,
        )
        self.capacity_pages = Gauge(
            "nanoflex_kv_capacity_pages",
            "KV pages each tier may hold (fixed at start, kept across engine restarts); "
            "absent for a tier bounded only by the machine.",
            ["tier"],
            registry=r,
        )
        self.failed_pages = Counter(
            "nanoflex_kv_cache_failed_pages",
            "Cached KV pages on disk that failed verification or could not be read when "
            "used: dropped, their tokens recomputed.",
            registry=r,
        )
        self.index_dropped = Counter(
            "nanoflex_kv_cache_index_dropped_entries",
            "Entries of the offload directory's disk-cache index dropped at engine start "
            "(damaged, malformed, of another model, failing their checksum).",
            registry=r,
        )
        self.offload_faults = Counter(
            "nanoflex_offload_faults",
            "Engine steps that failed on the offload directory (disk full, I/O error): their "
            "requests were recomputed, not lost.",
            registry=r,
        )
        self.engine_restarts = Counter(
            "nanoflex_engine_restarts",
            "Times the engine process was restarted after a crash.",
            registry=r,
        )
        self._follow = _Follower()
        self.tier_bytes = Gauge(
            "nanoflex_tier_bytes", "Bytes resident per memory tier.", ["tier"], registry=r
        )
        self.ttft = Histogram(
            "nanoflex_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "nanoflex_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for tier in TIERS:  # every series from the start, before the first step
            for labelled in (self.cache_hit_pages, self.spilled_bytes, self.loaded_bytes):
                labelled.labels(tier=tier)
            for gauge in (self.cached_pages, self.used_pages, self.tier_bytes):
                gauge.labels(tier=tier).set(0)
        engine.add_step_listener(self.on_step)

    def on_step(self, stats: StepStats) -> None:
        if stats.batch_size > 0:  # 0: no step ran, only the queues changed (aborts, restart)
            self.step_seconds.observe(stats.step_seconds)
            self.batch_size.observe(stats.batch_size)
        follow, cache = self._follow, stats.prefix_cache
        follow(self.preemptions, stats.num_preemptions)
        follow(self.cache_queries, cache.query_tokens)
        follow(self.cache_hits, cache.hit_tokens)
        follow(self.state_hits, cache.state_hits)
        follow(self.state_saves, cache.state_saves)
        follow(self.evicted_pages, cache.evicted_pages)
        follow(self.failed_pages, cache.failed_pages)
        follow(self.offload_faults, stats.offload_faults)
        follow(self.index_dropped, stats.index_dropped)
        follow(self.engine_restarts, stats.num_restarts)
        for tier in cache.hit_pages:
            follow(self.cache_hit_pages, cache.hit_pages[tier], tier)
            follow(self.spilled_bytes, cache.spilled_pages[tier] * stats.page_bytes, tier)
            follow(self.loaded_bytes, cache.loaded_pages[tier] * stats.page_bytes, tier)
        for tier, num_pages in stats.cached_pages.items():
            self.cached_pages.labels(tier=tier).set(num_pages)
        for tier, num_pages in stats.used_pages.items():
            self.used_pages.labels(tier=tier).set(num_pages)
        for tier, capacity in stats.capacity_pages.items():
            if capacity is not None:
                self.capacity_pages.labels(tier=tier).set(capacity)
        self.requests_waiting.set(stats.num_waiting)
        self.requests_running.set(stats.num_running)
        for name, (num_waiting, num_running) in stats.queues.items():
            self.queue_waiting.labels(queue=name).set(num_waiting)
            self.queue_running.labels(queue=name).set(num_running)
        for tier, num_bytes in stats.bytes_per_tier.items():
            self.tier_bytes.labels(tier=tier).set(num_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
