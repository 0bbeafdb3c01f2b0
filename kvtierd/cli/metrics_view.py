"""What `kvtierctl top` shows, computed from kvtierd's /metrics text: rates, hit rates, quantiles.

Rates are taken over the daemon's own clock (`kvtierd_uptime_seconds`), so a
slow scrape does not skew them. With one scrape (the first frame, `--once`),
they are averages since the daemon started; after that, over the last interval.
A daemon that restarted between two scrapes (its uptime went back) counts from
its start again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Scrape:
    samples: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Raises ValueError for text that is not the Prometheus text format."""
        return cls({(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples})

    def value(self, name: str, **labels: str) -> float:
        """The sum of the `name` samples carrying these labels (0 when there is none)."""
        want = labels.items()
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= dict(ls).items())

    def label_values(self, name: str, label: str) -> list[str]:
        """The values `label` takes on the `name` samples, in exposition order."""
        return list(dict.fromkeys(dict(ls)[label] for n, ls in self.samples if n == name and label in dict(ls)))

    def buckets(self, histogram: str, **labels: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of a histogram's buckets, lowest bound first."""
        found = {float(le): self.value(f"{histogram}_bucket", le=le, **labels)
                 for le in self.label_values(f"{histogram}_bucket", "le")}
        return sorted(found.items())


EMPTY = Scrape({})


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate: linear inside the bucket that holds the q-th observation;
    the highest finite bound when that is the +Inf bucket. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True, slots=True)
class Latency:
    priority: str
    count: int  # requests whose first token came in the window
    p50_s: float | None
    p95_s: float | None


@dataclass(frozen=True, slots=True)
class TransferView:
    tier: str
    direction: str  # load or store
    count: int  # transfers in the window
    p50_s: float | None
    p95_s: float | None
    bytes_per_s: float  # KV bytes moved in the window / the window


@dataclass(frozen=True, slots=True)
class TopView:
    uptime_s: float
    window_s: float
    since_start: bool  # rates are averages since the daemon started
    running: int
    waiting: int
    active_streams: int
    requests_total: int
    requests_per_s: float
    prompt_tokens_per_s: float
    generated_tokens_per_s: float
    hit_rate_by_tier: dict[str, float]  # hit tokens / prompt tokens in the window
    hit_rate_by_source: dict[str, float]
    pages: dict[str, dict[str, int]]  # tier -> used, cached, free, capacity
    fragmentation: float
    session_pools: int
    evictions: dict[str, int]  # reason -> pages in the window
    errors: dict[str, int]  # status class -> responses in the window
    ttft: list[Latency]
    loading: int = 0  # requests waiting for their prefix to load from below
    transfers_in_flight: int = 0
    loads_past_deadline: int = 0  # in the window: requests that recomputed instead of waiting longer
    transfers: list[TransferView] | None = None


def top_view(cur: Scrape, prev: Scrape | None = None) -> TopView:
    uptime = cur.value("kvtierd_uptime_seconds")
    since_start = prev is None or prev.value("kvtierd_uptime_seconds") > uptime
    base = EMPTY if since_start else prev
    window = uptime - base.value("kvtierd_uptime_seconds")

    def delta(name: str, **labels: str) -> float:
        return cur.value(name, **labels) - base.value(name, **labels)

    def rate(name: str) -> float:
        return delta(name) / window if window > 0 else 0.0

    prompt = delta("kvtierd_prompt_tokens_total")

    def hit_rates(name: str, label: str) -> dict[str, float]:
        return {v: delta(name, **{label: v}) / prompt if prompt else 0.0 for v in cur.label_values(name, label)}

    def ttft(priority: str) -> Latency:
        before = dict(base.buckets("kvtierd_ttft_seconds", priority=priority))
        buckets = [(bound, count - before.get(bound, 0.0))
                   for bound, count in cur.buckets("kvtierd_ttft_seconds", priority=priority)]
        return Latency(priority, round(delta("kvtierd_ttft_seconds_count", priority=priority)),
                       histogram_quantile(0.5, buckets), histogram_quantile(0.95, buckets))

    def window_buckets(name: str, **labels: str) -> list[tuple[float, float]]:
        before = dict(base.buckets(name, **labels))
        return [(bound, count - before.get(bound, 0.0)) for bound, count in cur.buckets(name, **labels)]

    def transfer(tier: str, direction: str) -> TransferView:
        buckets = window_buckets("kvtierd_transfer_seconds", tier=tier, direction=direction)
        moved = delta("kvtierd_transfer_bytes_total", tier=tier, direction=direction)
        return TransferView(tier, direction, round(delta("kvtierd_transfer_seconds_count", tier=tier,
                                                         direction=direction)),
                            histogram_quantile(0.5, buckets), histogram_quantile(0.95, buckets),
                            moved / window if window > 0 else 0.0)

    kinds = dict.fromkeys((dict(ls)["tier"], dict(ls)["direction"]) for n, ls in cur.samples
                          if n == "kvtierd_transfer_seconds_count")
    return TopView(
        uptime_s=uptime, window_s=window, since_start=since_start,
        running=round(cur.value("kvtierd_engine_requests", state="running")),
        waiting=round(cur.value("kvtierd_engine_requests", state="waiting")),
        active_streams=round(cur.value("kvtierd_http_active_streams")),
        requests_total=round(cur.value("kvtierd_requests_total")),
        requests_per_s=rate("kvtierd_requests_total"),
        prompt_tokens_per_s=rate("kvtierd_prompt_tokens_total"),
        generated_tokens_per_s=rate("kvtierd_generated_tokens_total"),
        hit_rate_by_tier=hit_rates("kvtierd_cache_hit_tokens_total", "tier"),
        hit_rate_by_source=hit_rates("kvtierd_cache_hit_tokens_by_source_total", "source"),
        pages={tier: {state: round(cur.value("kvtierd_pages", tier=tier, state=state))
                      for state in ("used", "cached", "free")}
               | {"capacity": round(cur.value("kvtierd_pages_capacity", tier=tier))}
               for tier in cur.label_values("kvtierd_pages", "tier")},
        fragmentation=cur.value("kvtierd_page_fragmentation_ratio"),
        session_pools=round(cur.value("kvtierd_session_pools")),
        evictions={r: round(delta("kvtierd_cache_evictions_total", reason=r))
                   for r in cur.label_values("kvtierd_cache_evictions_total", "reason")},
        errors={c: round(delta("kvtierd_http_errors_total", status_class=c))
                for c in cur.label_values("kvtierd_http_errors_total", "status_class")},
        ttft=[ttft(p) for p in cur.label_values("kvtierd_ttft_seconds_count", "priority")],
        loading=round(cur.value("kvtierd_engine_requests", state="loading")),
        transfers_in_flight=round(cur.value("kvtierd_transfers_in_flight")),
        loads_past_deadline=round(delta("kvtierd_loads_past_deadline_total")),
        transfers=[transfer(tier, direction) for tier, direction in kinds],
    )
