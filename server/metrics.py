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

from server.engine_client import EngineClient, StepStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = CONTENT_TYPE_LATEST


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
            "Online requests refused with 429 (queue full).",
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
        self._preemptions_seen = 0
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
        engine.add_step_listener(self.on_step)

    def on_step(self, stats: StepStats) -> None:
        if stats.batch_size > 0:  # 0: no step ran, only the queues changed (aborts, restart)
            self.step_seconds.observe(stats.step_seconds)
            self.batch_size.observe(stats.batch_size)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        self.requests_waiting.set(stats.num_waiting)
        self.requests_running.set(stats.num_running)
        for tier, num_bytes in stats.bytes_per_tier.items():
            self.tier_bytes.labels(tier=tier).set(num_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
