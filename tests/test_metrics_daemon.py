"""/metrics on the real daemon: it parses, and its counters move exactly as a scripted workload says.

Each test scrapes before and after its own requests on a fresh tenant and
compares the differences with what the responses themselves report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_fixtures import wait_idle
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.cli.metrics_view import Scrape

TENANT = "X-Kvtierd-Tenant"
PROMPT = [{"role": "user", "content": "Explain in one sentence why a cache makes a second identical request cheap. " * 2}]
CHAT = {"messages": PROMPT, "max_tokens": 4, "temperature": 0}

FAMILIES = {  # name (as the parser gives it: a counter without _total) -> type
    "kvtierd_uptime_seconds": "gauge",
    "kvtierd_requests": "counter",
    "kvtierd_engine_requests": "gauge",
    "kvtierd_prompt_tokens": "counter",
    "kvtierd_cache_hit_tokens": "counter",
    "kvtierd_cache_hit_tokens_by_source": "counter",
    "kvtierd_generated_tokens": "counter",
    "kvtierd_preemptions": "counter",
    "kvtierd_aborted_requests": "counter",
    "kvtierd_pages": "gauge",
    "kvtierd_pages_capacity": "gauge",
    "kvtierd_cache_evictions": "counter",
    "kvtierd_cache_token_mismatches": "counter",
    "kvtierd_session_pools": "gauge",
    "kvtierd_page_fragmentation_ratio": "gauge",
    "kvtierd_free_space_fragmentation_ratio": "gauge",
    "kvtierd_sequence_fragmentation_ratio": "gauge",
    "kvtierd_compactions": "counter",
    "kvtierd_compacted_pages": "counter",
    "kvtierd_engine_last_step_seconds": "gauge",
    "kvtierd_engine_last_step_tokens": "gauge",
    "kvtierd_engine_last_step_threads": "gauge",
    "kvtierd_ttft_seconds": "histogram",
    "kvtierd_inter_token_latency_seconds": "histogram",
    "kvtierd_queue_time_seconds": "histogram",
    "kvtierd_tier_bytes": "gauge",
    "kvtierd_tier_chunks": "gauge",
    "kvtierd_tier_writes": "counter",
    "kvtierd_tier_dropped_writes": "counter",
    "kvtierd_tier_pending_writes": "gauge",
    "kvtierd_tier_evictions": "counter",
    "kvtierd_tier_corrupt_values": "counter",
    "kvtierd_tier_healthy": "gauge",
    "kvtierd_http_responses": "counter",
    "kvtierd_http_errors": "counter",
    "kvtierd_http_active_streams": "gauge",
}


@pytest.fixture(scope="module")
def http(daemon) -> Iterator[httpx.Client]:
    with daemon.client() as client:
        yield client


def fresh_tenant() -> dict[str, str]:
    return {TENANT: f"metrics-{uuid.uuid4().hex[:8]}"}  # root may name tenants: a cold cache namespace


def scrape(http: httpx.Client) -> Scrape:
    r = http.get("/metrics")
    assert r.status_code == 200
    return Scrape.parse(r.text)


def grew(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_metrics_parse_and_every_family_has_help_and_type(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    families = list(text_string_to_metric_families(r.text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    for f in families:  # a sample with no TYPE line would parse into an "unknown" family
        assert f.documentation and f.type in ("counter", "gauge", "histogram"), f.name
        exposed = f.name + "_total" if f.type == "counter" else f.name  # the parser drops a counter's _total
        assert f"# HELP {exposed} " in r.text and f"# TYPE {exposed} {f.type}\n" in r.text, f.name
    assert FAMILIES.items() <= {f.name: f.type for f in families}.items()


def test_the_readme_lists_every_family(http):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for f in text_string_to_metric_families(http.get("/metrics").text):
        if not f.name.endswith("_created"):  # the client library's creation times, not ours
            exposed = f.name + "_total" if f.type == "counter" else f.name
            assert f"`{exposed}`" in readme, f"README.md does not list {exposed}"


def test_a_repeated_chat_moves_the_counters_exactly(http):
    headers = fresh_tenant()
    before = scrape(http)
    first = http.post("/v1/chat/completions", json=CHAT, headers=headers).json()
    second = http.post("/v1/chat/completions", json=CHAT, headers=headers).json()
    after = scrape(http)

    u1, u2 = first["usage"], second["usage"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0  # cold tenant, then a prefix hit
    assert second["kvtierd"]["cache_source"] == "prefix"
    assert grew(before, after, "kvtierd_requests_total") == 2
    assert grew(before, after, "kvtierd_prompt_tokens_total") == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert grew(before, after, "kvtierd_cache_hit_tokens_total", tier="device") == cached
    assert grew(before, after, "kvtierd_cache_hit_tokens_by_source_total", source="prefix") == cached
    assert grew(before, after, "kvtierd_generated_tokens_total") == u1["completion_tokens"] + u2["completion_tokens"]
    assert grew(before, after, "kvtierd_ttft_seconds_count", priority="normal") == 2
    assert grew(before, after, "kvtierd_queue_time_seconds_count", priority="normal") == 2
    # one gap between each two tokens of a reply
    gaps = u1["completion_tokens"] - 1 + u2["completion_tokens"] - 1
    assert grew(before, after, "kvtierd_inter_token_latency_seconds_count", priority="normal") == gaps
    assert grew(before, after, "kvtierd_ttft_seconds_count", priority="high") == 0
    assert grew(before, after, "kvtierd_http_responses_total", route="/v1/chat/completions", status_class="2xx") == 2


def test_a_high_priority_request_lands_in_the_high_series(http):
    before = scrape(http)
    r = http.post("/v1/chat/completions", json={**CHAT, "priority": "high", "stream": True}, headers=fresh_tenant())
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    after = scrape(http)
    assert grew(before, after, "kvtierd_ttft_seconds_count", priority="high") == 1
    assert grew(before, after, "kvtierd_queue_time_seconds_count", priority="high") == 1
    assert grew(before, after, "kvtierd_ttft_seconds_count", priority="normal") == 0
    assert after.value("kvtierd_http_active_streams") == 0  # the stream ended


def test_a_bad_request_moves_the_4xx_counters_by_one(http):
    before = scrape(http)
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert http.get("/no/such/route").status_code == 404
    after = scrape(http)
    assert grew(before, after, "kvtierd_http_errors_total", status_class="4xx") == 2
    assert grew(before, after, "kvtierd_http_errors_total", status_class="5xx") == 0
    assert grew(before, after, "kvtierd_http_responses_total", route="/v1/chat/completions", status_class="4xx") == 1
    assert grew(before, after, "kvtierd_http_responses_total", route="unmatched", status_class="4xx") == 1
    assert grew(before, after, "kvtierd_requests_total") == 0  # refused before the engine


def test_a_session_turn_counts_its_hit_under_source_session(http):
    headers = fresh_tenant()
    sid = http.post("/v1/sessions", json={"system_prompt": "You are terse."}, headers=headers).json()["id"]
    assert http.post(f"/v1/sessions/{sid}/messages", json={"content": "Name a colour.", "max_tokens": 4},
                     headers=headers).status_code == 200
    before = scrape(http)
    turn = http.post(f"/v1/sessions/{sid}/messages", json={"content": "And another.", "max_tokens": 4},
                     headers=headers).json()
    after = scrape(http)
    cached = turn["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert turn["kvtierd"]["cache_source"] == "session" and cached > 0
    assert grew(before, after, "kvtierd_cache_hit_tokens_by_source_total", source="session") == cached
    assert grew(before, after, "kvtierd_cache_hit_tokens_total", tier="device") == cached
    assert after.value("kvtierd_session_pools") >= 1


def settled(http) -> Scrape:
    """A scrape once no page is held: a finished session turn's pages stay referenced until its store, which
    waits for the engine's idle spell, has copied them out."""
    wait_idle(http)
    return scrape(http)


def test_invalidating_a_tenant_counts_its_pages_as_invalidated_evictions(http):
    headers = fresh_tenant()
    assert http.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    before = scrape(http)
    pages = http.post("/admin/invalidate", json={"tenant": headers[TENANT]}).json()["invalidated_pages"]
    after = settled(http)
    assert pages > 0
    assert grew(before, after, "kvtierd_cache_evictions_total", tier="device", reason="invalidated") == pages
    assert grew(before, after, "kvtierd_cache_evictions_total", tier="device", reason="capacity") == 0
    # the pages stay allocatable: nothing runs now, so every page is cached or free
    used, cached, free = (after.value("kvtierd_pages", tier="device", state=s) for s in ("used", "cached", "free"))
    assert used == 0 and used + cached + free == after.value("kvtierd_pages_capacity", tier="device")


def ctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtierd.cli.ctl", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def test_kvtierctl_top_once_prints_the_frame(daemon, http):
    assert http.post("/v1/chat/completions", json=CHAT, headers=fresh_tenant()).status_code == 200
    now = settled(http)  # nothing runs between this and kvtierctl's own scrape
    done = ctl(daemon, "top", "--once")
    assert done.returncode == 0 and not done.stderr, done.stderr
    out = done.stdout
    used, cached, free = (round(now.value("kvtierd_pages", tier="device", state=s)) for s in ("used", "cached", "free"))
    capacity = round(now.value("kvtierd_pages_capacity", tier="device"))
    assert "kvtierd top" in out and "rates since start" in out
    assert f"{round(now.value('kvtierd_requests_total')):,} total" in out
    assert f"{used:,} used · {cached:,} cached · {free:,} free of {capacity:,}" in out
    assert "Time to first token" in out and all(p in out for p in ("high", "normal", "low"))

    frame = json.loads(ctl(daemon, "--json", "top", "--once").stdout)
    assert frame["since_start"] is True and frame["requests_total"] == now.value("kvtierd_requests_total")
    assert frame["pages"]["device"] == {"used": used, "cached": cached, "free": free, "capacity": capacity}
    normal = {row["priority"]: row for row in frame["ttft"]}["normal"]
    assert normal["count"] == now.value("kvtierd_ttft_seconds_count", priority="normal") and normal["p50_s"] > 0


def test_the_lower_tiers_report_their_health_and_capacity(http):
    s = scrape(http)
    for tier in ("host", "disk"):
        assert s.value("kvtierd_tier_healthy", tier=tier) == 1
        assert s.value("kvtierd_tier_bytes", tier=tier, state="capacity") > 0
