"""The server's own Prometheus metrics: latencies and HTTP responses, observed where they happen.

Each app owns a `CollectorRegistry` (tests run several apps in one process, and
the global registry would mix them). Numbers the engine already counts are not
kept twice: `engine_metrics.EngineCollector` reads them when /metrics is scraped.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector

from kvtierd.server.schemas import PRIORITIES

CACHE_SOURCES = ("session", "prefix", "public")
# Seconds. TTFT spans a GPU's milliseconds to a CPU's long prefills; a token gap is shorter.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvtierd_ttft_seconds", "Time from a request's arrival to its first token, by priority.",
                              ["priority"], registry=r, buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram("kvtierd_inter_token_latency_seconds",
                                     "Time between two streamed tokens of a request, by priority.",
                                     ["priority"], registry=r, buckets=TOKEN_GAP_BUCKETS)
        self.queue = Histogram("kvtierd_queue_time_seconds",
                               "Time from a request's arrival to its first scheduled step, by priority.",
                               ["priority"], registry=r, buckets=LATENCY_BUCKETS)
        self.hits_by_source = Counter("kvtierd_cache_hit_tokens_by_source",
                                      "Prompt tokens served from the cache, by where the hit was found.",
                                      ["source"], registry=r)
        self.responses = Counter("kvtierd_http_responses", "HTTP responses, by route and status class.",
                                 ["route", "status_class"], registry=r)
        for p in PRIORITIES:  # every series exists from the start, so rates work from the first scrape
            for h in (self.ttft, self.inter_token, self.queue):
                h.labels(p)
        for s in CACHE_SOURCES:
            self.hits_by_source.labels(s)

    def observer(self, priority: str) -> RequestObserver:
        return RequestObserver(self.ttft.labels(priority), self.inter_token.labels(priority),
                               self.queue.labels(priority), self.hits_by_source)

    def observe_response(self, route: str, status: int) -> None:
        self.responses.labels(route, f"{status // 100}xx").inc()

    def render(self, engine: Collector) -> bytes:
        """The text exposition: the engine's families (read for this scrape), then this registry's."""
        return generate_latest(engine) + generate_latest(self.registry)


@dataclass(slots=True)
class RequestObserver:
    """One request's series (its priority's histograms), resolved once; `Generation` calls it as outputs arrive."""

    ttft: Histogram
    inter_token: Histogram
    queue: Histogram
    hits_by_source: Counter

    def first_output(self, ttft_s: float, queue_s: float, cached_tokens: int, source: str) -> None:
        self.ttft.observe(ttft_s)
        self.queue.observe(queue_s)
        if source in CACHE_SOURCES:
            self.hits_by_source.labels(source).inc(cached_tokens)

    def next_token(self, gap_s: float) -> None:
        self.inter_token.observe(gap_s)
