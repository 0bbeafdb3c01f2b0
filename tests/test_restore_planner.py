"""The restore planner: load the leading chunks whose cumulative saving over recomputing is largest."""

from __future__ import annotations

import pytest

from kvtierd.tiers.restore_planner import ChunkCost, RestorePlanner

MB = 1 << 20


def planner(host_bps: float | None = None, remote_bps: float | None = None, prefill_tps: float | None = None):
    p = RestorePlanner()
    if host_bps:
        p.observe_load("host", int(host_bps), 1.0)
    if remote_bps:
        p.observe_load("remote", int(remote_bps), 1.0)
    if prefill_tps:
        p.observe_prefill(int(prefill_tps), 1.0)
    return p


def chunk(tier: str, mb: int = 12, tokens: int = 256) -> ChunkCost:
    return ChunkCost(tier, mb * MB, tokens)


def test_until_both_rates_are_measured_everything_is_loaded() -> None:
    chunks = [chunk("host"), chunk("remote")]
    for p in (planner(), planner(host_bps=1e9, remote_bps=1e9), planner(prefill_tps=1e9)):
        plan = p.plan(chunks)
        assert (plan.num_chunks, plan.decision) == (2, "load")


def test_a_slow_cpu_prefill_loads_everything() -> None:
    plan = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=500).plan([chunk("host"), chunk("remote")])
    assert plan.decision == "load"
    assert plan.load_s == pytest.approx(12 * MB / 3e9 + 12 * MB / 1e8)
    assert plan.recompute_s == pytest.approx(512 / 500)


def test_fast_prefill_recomputes_instead_of_a_slow_remote_load() -> None:
    # 256 tokens at 20k tok/s: 12.8 ms; 12 MB from host at 3 GB/s: 4.2 ms, from remote at 0.1 GB/s: 126 ms.
    p = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=20_000)
    plan = p.plan([chunk("host"), chunk("host"), chunk("remote")])
    assert (plan.num_chunks, plan.decision) == (2, "partial")
    plan = p.plan([chunk("remote"), chunk("host")])  # host after remote: the remote chunk is needed first
    assert (plan.num_chunks, plan.decision) == (0, "recompute")
    assert p.decisions == {"partial": 1, "recompute": 1}


def test_a_later_saving_can_pay_for_an_earlier_loss() -> None:
    # A small remote chunk that loses a little, then host chunks that win more: load all.
    p = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=20_000)
    plan = p.plan([chunk("remote", mb=1, tokens=32), chunk("host"), chunk("host")])
    assert plan.decision == "load"


def test_nothing_found_is_not_a_decision() -> None:
    p = planner()
    assert p.plan([]).decision == "none" and not p.decisions


def test_rates_are_moving_averages_and_short_timings_are_pooled() -> None:
    p = RestorePlanner()
    p.observe_load("disk", 100, 1.0)
    p.observe_load("disk", 200, 1.0)
    assert p.rates()[0]["disk"] == pytest.approx(120)  # 100 + 0.2 * (200 - 100)
    p.observe_load("disk", 10**3, 2e-5)  # too short to count alone: held back
    p.observe_prefill(0, 1.0)  # nothing computed: no rate
    assert p.rates() == ({"disk": pytest.approx(120)}, None)
    p.observe_load("disk", 4 * 10**3, 8e-5)  # with the one held back: 5,000 bytes in 0.1 ms
    assert p.rates()[0]["disk"] == pytest.approx(120 + 0.2 * (5e7 - 120))


def test_the_first_timing_sets_a_rate_however_short() -> None:
    """A fast host loads a small chunk in microseconds: the rate is known after one load all the same."""
    p = RestorePlanner()
    p.observe_load("host", 10**6, 1e-6)
    p.observe_prefill(16, 1e-6)
    assert p.rates() == ({"host": pytest.approx(1e12)}, pytest.approx(1.6e7))
