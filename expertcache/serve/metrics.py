"""Prometheus metrics of the server: the engine's cache statistics (read at scrape time from
its RunStats, which span every request since start), queue length, and request latency."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .scheduler import Request, Scheduler

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """The server's Prometheus registry: engine statistics as gauges read at scrape time, request
    outcomes and latencies observed as each request ends."""
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler: Scheduler):
        self.registry = r = CollectorRegistry()
        stats = scheduler.engine.stats
        scheduler.on_finish = self.observe

        def gauge(name: str, doc: str, read) -> None:
            Gauge(f"expertcache_{name}", doc, registry=r).set_function(read)

        gauge("tokens_per_second", "tokens through the model per second of model time (prompt and decode)",
              lambda: stats.tokens / stats.wall_s if stats.wall_s else 0.0)
        gauge("model_tokens", "tokens through the model since start", lambda: stats.tokens)
        gauge("generated_tokens", "tokens generated since start", lambda: scheduler.generated_tokens)
        gauge("prompt_tokens", "prompt tokens prefilled since start", lambda: scheduler.prompt_tokens)
        gauge("cache_hit_rate", "routed experts resident at decision time / routed", lambda: stats.hit_rate)
        gauge("fetches_per_token", "synchronous expert fetches per token", lambda: stats.fetches_per_token)
        gauge("stall_seconds", "time blocked waiting on expert transfers since start", lambda: stats.stall_s)
        gauge("substituted_mass_per_call", "gate weight of substituted experts per token and layer",
              lambda: stats.mass_per_call)
        gauge("queue_length", "requests waiting for admission", lambda: scheduler.queue_length)
        gauge("active_requests", "requests being generated", lambda: len(scheduler.active))
        self.finished = Counter("expertcache_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.latency = Histogram("expertcache_request_latency_seconds", "submission to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("expertcache_time_to_first_token_seconds", "submission to first token",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def observe(self, request: Request, outcome: str) -> None:
        """Called by the worker when a request ends."""
        self.finished.labels(outcome).inc()
        self.latency.observe(request.finished - request.submitted)
        if request.first_token is not None:
            self.first_token.observe(request.first_token - request.submitted)

    def render(self) -> bytes:
        """The metrics in Prometheus text format (of `content_type`)."""
        return generate_latest(self.registry)
