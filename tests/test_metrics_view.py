"""kvtierctl top's math on hand-written exposition text: parsing, rates, hit rates, histogram quantiles."""

from __future__ import annotations

import math

import pytest

from kvtierd.cli.metrics_view import Scrape, histogram_quantile, top_view

BOUNDS = ("0.1", "0.5", "1.0", "+Inf")


def exposition(uptime: float, requests: int, prompt: int, hits: int, session_hits: int, ttft_normal: tuple[int, ...],
               invalidated: int = 0) -> str:
    """A /metrics text as kvtierd writes it; `ttft_normal` is the cumulative count of each of BOUNDS."""
    buckets = "\n".join(f'kvtierd_ttft_seconds_bucket{{le="{le}",priority="normal"}} {n}'
                        for le, n in zip(BOUNDS, ttft_normal))
    empty = "\n".join(f'kvtierd_ttft_seconds_bucket{{le="{le}",priority="high"}} 0' for le in BOUNDS)
    return f"""\
# HELP kvtierd_uptime_seconds Seconds since the daemon started.
# TYPE kvtierd_uptime_seconds gauge
kvtierd_uptime_seconds {uptime}
# HELP kvtierd_requests_total Requests added to the engine.
# TYPE kvtierd_requests_total counter
kvtierd_requests_total {requests}
# HELP kvtierd_engine_requests Requests in the engine now, by state.
# TYPE kvtierd_engine_requests gauge
kvtierd_engine_requests{{state="running"}} 2
kvtierd_engine_requests{{state="waiting"}} 1
# HELP kvtierd_prompt_tokens_total Prompt tokens.
# TYPE kvtierd_prompt_tokens_total counter
kvtierd_prompt_tokens_total {prompt}
# HELP kvtierd_generated_tokens_total Tokens generated.
# TYPE kvtierd_generated_tokens_total counter
kvtierd_generated_tokens_total {2 * requests}
# HELP kvtierd_cache_hit_tokens_total Hits by tier.
# TYPE kvtierd_cache_hit_tokens_total counter
kvtierd_cache_hit_tokens_total{{tier="device"}} {hits}
# HELP kvtierd_cache_hit_tokens_by_source_total Hits by source.
# TYPE kvtierd_cache_hit_tokens_by_source_total counter
kvtierd_cache_hit_tokens_by_source_total{{source="session"}} {session_hits}
kvtierd_cache_hit_tokens_by_source_total{{source="prefix"}} {hits - session_hits}
kvtierd_cache_hit_tokens_by_source_total{{source="public"}} 0
# HELP kvtierd_pages Pages by state.
# TYPE kvtierd_pages gauge
kvtierd_pages{{state="used",tier="device"}} 10
kvtierd_pages{{state="cached",tier="device"}} 30
kvtierd_pages{{state="free",tier="device"}} 60
# HELP kvtierd_pages_capacity Pages a tier holds.
# TYPE kvtierd_pages_capacity gauge
kvtierd_pages_capacity{{tier="device"}} 100
# HELP kvtierd_cache_evictions_total Evictions by reason.
# TYPE kvtierd_cache_evictions_total counter
kvtierd_cache_evictions_total{{reason="capacity",tier="device"}} 5
kvtierd_cache_evictions_total{{reason="invalidated",tier="device"}} {invalidated}
# HELP kvtierd_ttft_seconds TTFT by priority.
# TYPE kvtierd_ttft_seconds histogram
{buckets}
kvtierd_ttft_seconds_count{{priority="normal"}} {ttft_normal[-1]}
kvtierd_ttft_seconds_sum{{priority="normal"}} 1.0
{empty}
kvtierd_ttft_seconds_count{{priority="high"}} 0
kvtierd_ttft_seconds_sum{{priority="high"}} 0
"""


def test_quantile_interpolates_inside_the_bucket_that_holds_the_rank():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # rank 1 of the 2 in [0, 0.1]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.4)  # rank 5: 3 of the 4 in (0.1, 0.5]
    assert histogram_quantile(0.8, buckets) == pytest.approx(1.0)  # rank 8: the top of (0.5, 1]
    assert histogram_quantile(0.95, buckets) == 1.0  # in +Inf: the highest finite bound


def test_quantile_skips_empty_buckets_and_is_none_without_observations():
    assert histogram_quantile(0.5, [(0.1, 0.0), (0.5, 0.0), (1.0, 4.0), (math.inf, 4.0)]) == pytest.approx(0.75)
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_scrape_sums_over_the_labels_not_asked_for():
    s = Scrape.parse(exposition(10, 4, 400, 100, 40, (1, 2, 3, 4)))
    assert s.value("kvtierd_requests_total") == 4
    assert s.value("kvtierd_pages", tier="device") == 100  # used + cached + free
    assert s.value("kvtierd_pages", state="cached") == 30
    assert s.value("kvtierd_no_such_metric") == 0
    assert s.label_values("kvtierd_cache_hit_tokens_by_source_total", "source") == ["session", "prefix", "public"]
    assert s.buckets("kvtierd_ttft_seconds", priority="normal") == [(0.1, 1), (0.5, 2), (1.0, 3), (math.inf, 4)]


def test_one_scrape_gives_averages_since_start():
    v = top_view(Scrape.parse(exposition(10, 4, 400, 100, 40, (2, 6, 8, 10), invalidated=3)))
    assert v.since_start and v.window_s == 10
    assert (v.running, v.waiting, v.requests_total) == (2, 1, 4)
    assert v.requests_per_s == pytest.approx(0.4) and v.prompt_tokens_per_s == pytest.approx(40)
    assert v.generated_tokens_per_s == pytest.approx(0.8)
    assert v.hit_rate_by_tier == {"device": 0.25}
    assert v.hit_rate_by_source == {"session": 0.1, "prefix": 0.15, "public": 0.0}
    assert v.pages == {"device": {"used": 10, "cached": 30, "free": 60, "capacity": 100}}
    assert v.evictions == {"capacity": 5, "invalidated": 3}
    normal = {row.priority: row for row in v.ttft}["normal"]
    assert normal.count == 10 and normal.p50_s == pytest.approx(0.4) and normal.p95_s == 1.0
    high = {row.priority: row for row in v.ttft}["high"]
    assert high.count == 0 and high.p50_s is None


def test_two_scrapes_give_rates_and_quantiles_over_the_interval():
    prev = Scrape.parse(exposition(10, 4, 400, 100, 40, (2, 6, 8, 10)))
    # 2 s later: 2 requests, 200 prompt tokens of which 150 hit; both first tokens came in under 0.1 s
    cur = Scrape.parse(exposition(12, 6, 600, 250, 40, (4, 8, 10, 12), invalidated=7))
    v = top_view(cur, prev)
    assert not v.since_start and v.window_s == 2
    assert v.requests_per_s == pytest.approx(1.0) and v.prompt_tokens_per_s == pytest.approx(100)
    assert v.hit_rate_by_tier == {"device": 0.75}
    assert v.hit_rate_by_source == {"session": 0.0, "prefix": 0.75, "public": 0.0}
    assert v.evictions == {"capacity": 0, "invalidated": 7}
    normal = {row.priority: row for row in v.ttft}["normal"]
    assert normal.count == 2 and normal.p50_s == pytest.approx(0.05) and normal.p95_s == pytest.approx(0.095)


def test_a_restarted_daemon_counts_from_its_start_again():
    prev = Scrape.parse(exposition(500, 90, 9000, 10, 0, (0, 0, 0, 0)))
    cur = Scrape.parse(exposition(5, 2, 100, 0, 0, (0, 0, 0, 0)))
    v = top_view(cur, prev)
    assert v.since_start and v.window_s == 5 and v.requests_per_s == pytest.approx(0.4)


def test_text_that_is_not_the_exposition_format_is_refused():
    with pytest.raises(ValueError):
        Scrape.parse("<html><body>not metrics</body></html>\n")
