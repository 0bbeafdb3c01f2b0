"""The workload recorder and `kvtierctl advise`'s reasoning, on constructed requests and statistics."""

from __future__ import annotations

import json
from dataclasses import replace

from kvtierd.cli.advice import MIB, Recommendation, recommend
from kvtierd.server.workload import (MAX_SESSIONS, RESERVOIR_SIZE, FinishedRequest, WorkloadRecorder, load_recorder,
                                     write_snapshot)
from kvtierd.server.workload_report import CacheFacts, Distribution, PageFit, WorkloadReport, WorkloadStats

T0 = 1_700_000_000.0
NO_HIT = {"device": 0, "host": 0, "disk": 0, "remote": 0}


def make_request(prompt: int, completion: int, *, session: str | None = None, tenant: str = "a", qos: str = "normal",
                 cached: int = 0, source: str = "none", by_tier: dict[str, int] | None = None, used: int = 0,
                 high: int = 0, at: float = 0.0, took: float = 1.0) -> FinishedRequest:
    return FinishedRequest(tenant, session, qos, prompt, completion, cached, by_tier or NO_HIT, source, used, high,
                           T0 + at, T0 + at + took)


# Three turns of one session (idle 10 s, then 30 s) and one high-class request with a prefix hit.
WORKLOAD = [
    make_request(40, 10, session="s1", used=64, at=0, took=2),
    make_request(70, 10, session="s1", cached=49, source="session", by_tier={"device": 49}, used=80, at=12),
    make_request(33, 1, tenant="b", qos="high", cached=32, source="prefix", by_tier={"device": 16, "host": 16},
                 used=48, high=48, at=20),
    make_request(100, 5, session="s1", qos="low", cached=79, source="session", by_tier={"device": 79}, used=112,
                 at=43, took=2),
]


def recorded(requests: list[FinishedRequest] = WORKLOAD) -> WorkloadRecorder:
    rec = WorkloadRecorder(seed=0)
    for r in requests:
        rec.record(r)
    return rec


def test_the_recorder_counts_tokens_sessions_gaps_sources_and_pages():
    s = recorded().stats(block_size=16)
    assert (s.num_requests, s.num_sessions, s.num_returns, s.span_s) == (4, 1, 2, 45.0)
    assert s.computed_tokens == (50 - 0) + (80 - 49) + (34 - 32) + (105 - 79)
    assert s.prompt_tokens == Distribution(4, 60.75, 40, 100, 100, 100)  # nearest rank over 33, 40, 70, 100
    assert s.completion_tokens == Distribution(4, 6.5, 5, 10, 10, 10)
    assert s.session_tokens == Distribution(3, 78.333, 80, 105, 105, 105)
    assert s.idle_gap_s == Distribution(2, 20.0, 10.0, 30.0, 30.0, 30.0)  # turn 2 came 10 s after turn 1 ended
    assert s.cached_tokens_by_source == {"session": 49 + 79, "prefix": 32}
    assert s.cached_tokens_by_tier == {"device": 49 + 16 + 79, "host": 16, "disk": 0, "remote": 0}
    assert s.requests_by_source == {"none": 1, "session": 2, "prefix": 1}
    # pages of 16 tokens: 50 -> 4, 80 -> 5, 34 -> 3 (high), 105 -> 7 (low)
    assert s.request_pages == {"high": Distribution(1, 3.0, 3, 3, 3, 3), "low": Distribution(1, 7.0, 7, 7, 7, 7),
                               "normal": Distribution(2, 4.5, 4, 5, 5, 5)}
    assert s.used_pages == Distribution(4, 4.75, 4, 7, 7, 7)
    assert s.high_pages == Distribution(1, 3.0, 3, 3, 3, 3)  # only high requests sample the high class


def test_page_fit_cuts_the_requests_into_each_candidate_size():
    fit = {f.block_size: f for f in recorded().stats(block_size=16).page_fit}
    assert sorted(fit) == [8, 16, 32, 64, 128]
    # 50, 80, 34, 105 tokens; session reuse ended at 49 and 79
    assert fit[16] == PageFit(16, pages=(4 + 5 + 3 + 7) / 4, tail_waste_tokens=(14 + 0 + 14 + 7) / 4,
                              resume_loss_tokens=(1 + 15) / 4)
    assert fit[8] == PageFit(8, pages=(7 + 10 + 5 + 14) / 4, tail_waste_tokens=(6 + 0 + 6 + 7) / 4,
                             resume_loss_tokens=(1 + 7) / 4)


def test_memory_stays_bounded_however_many_requests():
    rec = WorkloadRecorder(seed=1)
    n = MAX_SESSIONS + 100  # > RESERVOIR_SIZE too
    for i in range(n):
        rec.record(make_request(i + 1, 1, session=f"s{i}", at=i))
    assert len(rec.prompt_tokens.samples) == RESERVOIR_SIZE
    assert len(rec.sessions) == MAX_SESSIONS and ("a", "s0") not in rec.sessions  # the oldest are forgotten
    p = rec.stats(16).prompt_tokens
    assert (p.count, p.max) == (n, n)  # count and max stay exact
    assert 0.4 * n < p.p50 < 0.6 * n  # a uniform sample of 1..n


def test_the_snapshot_round_trips_and_a_return_after_a_restart_has_its_gap(tmp_path):
    path = tmp_path / "workload.json"
    write_snapshot(path, recorded().to_json())
    assert not (tmp_path / "workload.json.tmp").exists()
    loaded = load_recorder(path)
    assert loaded.stats(16) == recorded().stats(16)
    loaded.record(make_request(120, 2, session="s1", cached=104, source="session", at=145))  # 100 s after turn 3
    s = loaded.stats(16)
    assert (s.num_requests, s.num_returns, s.idle_gap_s.max) == (5, 3, 100.0)
    assert s.span_s == 45.0 + 1.0  # this run's span adds to the earlier runs'


def test_a_missing_or_unreadable_snapshot_starts_afresh(tmp_path):
    assert load_recorder(tmp_path / "none.json").num_requests == 0
    for text in ("{", json.dumps({"version": 99}), json.dumps({"version": 1})):
        (tmp_path / "bad.json").write_text(text)
        assert load_recorder(tmp_path / "bad.json").num_requests == 0


# --- the advice ---------------------------------------------------------------------------------

FACTS = CacheFacts(block_size=16, device_pages=1000, bytes_per_page=49152, kv_cache_bytes=1 << 30,
                   host_bytes=2 << 30, disk_bytes=16 << 30, context_window=2048, reserved_share=0.1,
                   reserved_min_share=0.05, reserved_max_share=0.5, reserved_pages=100, reserved_floor=50,
                   reserved_ceiling=500)


def dist(count: int, p50: float = 0, p90: float = 0, p99: float = 0) -> Distribution:
    return Distribution(count, p50, p50, p90, p99, p99)


STATS = WorkloadStats(
    num_requests=100, num_sessions=20, num_returns=80, span_s=1000.0, computed_tokens=50_000,
    prompt_tokens=dist(100, 200, 400, 500), completion_tokens=dist(100, 50, 90, 100),
    session_tokens=dist(100, 300, 600, 900), idle_gap_s=dist(80, 30.0, 120.0, 600.0),
    cached_tokens_by_source={"session": 9000}, cached_tokens_by_tier={"device": 9000}, requests_by_source={},
    request_pages={"high": dist(30, 10, 15, 20)}, used_pages=dist(100, 20, 30, 40), high_pages=dist(30, 10, 15, 20),
    page_fit=[PageFit(8, 40, 3.5, 2), PageFit(16, 20, 7.5, 4), PageFit(32, 10, 15.5, 8), PageFit(64, 5, 31.5, 16),
              PageFit(128, 2.5, 63.5, 32)],
)


def advice(stats: WorkloadStats = STATS, facts: CacheFacts = FACTS) -> dict[str, Recommendation]:
    return {r.setting: r for r in recommend(WorkloadReport(stats, facts))}


def test_block_size_is_the_cheapest_candidate():
    got = advice()["block_size"]
    # costs 45.5, 31.5, 33.5, 52.5, 98: pages + empty tail slots + partial pages at resumes
    assert (got.current, got.recommended) == (16, 16)
    assert "16: 20.0 + 7.5 + 4.0 = 31.5" in got.why and "32: 10.0 + 15.5 + 8.0 = 33.5" in got.why
    long = [PageFit(8, 125, 0, 0), PageFit(16, 63, 8, 0), PageFit(32, 32, 24, 0), PageFit(64, 16, 24, 0),
            PageFit(128, 8, 24, 0)]  # 1,000-token requests with no session reuse
    assert advice(replace(STATS, page_fit=long))["block_size"].recommended == 128


def test_tier_sizes_hold_the_returns_within_the_median_p90_and_p99_gaps():
    got = advice()
    # 50,000 tokens written over 1,000 s = 50 tokens/s; 3,072 bytes per token
    # device: p99 40 pages in use + 30 s x 50 = 1,500 tokens = 94 pages -> 134 pages x 49,152 bytes -> 7 MiB
    assert got["kv_cache_bytes"].recommended == 7 * MIB
    assert got["kv_cache_bytes"].why.startswith("p99 40 pages in use + 94 pages for the half of 80 session returns")
    assert "= 134 pages; x 49,152 bytes" in got["kv_cache_bytes"].why
    assert got["host_bytes"].recommended == 18 * MIB  # 120 s x 50 = 6,000 tokens x 3,072 bytes = 17.6 MiB
    assert got["disk_bytes"].recommended == 88 * MIB  # 600 s x 50 = 30,000 tokens = 87.9 MiB
    assert "90% of 80 session returns came within 120.0 s" in got["host_bytes"].why
    small = advice(replace(STATS, idle_gap_s=dist(80, 1.0, 2.0, 3.0)))["kv_cache_bytes"]
    assert small.recommended == 6 * MIB and "raised to one context window, 128 pages" in small.why  # x 49,152


def test_reserved_share_follows_the_high_class_p99_within_floor_and_ceiling():
    def share(p99: float) -> float | None:
        return advice(replace(STATS, high_pages=dist(30, 1, 1, p99)))["reserved_share"].recommended

    assert share(100) == 0.15  # 100 x 1.5 = 150 of 1,000 pages
    assert share(101) == 0.152  # 152 pages: rounded up
    assert share(20) == 0.05  # 30 pages, under the floor
    assert share(400) == 0.5  # 600 pages, over the ceiling
    assert advice(replace(STATS, high_pages=dist(0)))["reserved_share"].recommended == 0.0


def test_too_little_data_says_so_instead_of_guessing():
    few = advice(replace(STATS, num_requests=19))
    assert all(r.recommended is None for r in few.values())
    assert few["block_size"].why == "not enough data: 19 requests recorded, 20 needed"
    no_returns = advice(replace(STATS, num_returns=5))
    assert no_returns["host_bytes"].recommended is None and no_returns["block_size"].recommended == 16
    assert no_returns["disk_bytes"].why == "not enough data: 5 session returns recorded, 10 needed"
    assert advice(replace(STATS, high_pages=dist(3, 1, 1, 1)))["reserved_share"].recommended is None


def test_the_report_round_trips_through_json():
    report = WorkloadReport(recorded().stats(16), FACTS)
    assert WorkloadReport.from_json(json.loads(json.dumps(report.to_json()))) == report
