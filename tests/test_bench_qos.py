"""`kvtierd bench qos-engine` at tiny sizes: every run is there, the figures have the right shape, and the resizing
reserve's series makes a PNG."""

from __future__ import annotations

from kvtierd.bench.plot import plot_reserve
from kvtierd.bench.qos_engine_bench import QosWorkload, run_qos_bench

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_qos_bench_runs_every_scenario_and_plots_the_resizing_reserve(loaded, tmp_path):
    w = QosWorkload(kv_pages=24, low_sessions=3, low_prompt_tokens=64, low_reply_tokens=8, high_requests=2,
                    high_prompt_tokens=20, high_reply_tokens=2, high_every_s=0.05)
    figures = run_qos_bench(loaded, w)
    assert [r["run"] for r in figures["runs"]] == ["unloaded", "reserved", "resizing", "no reserve", "no qos"]
    for r in figures["runs"]:
        assert r["high_requests"] == 2 and 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"]
    unloaded, reserved, resizing, no_reserve, _ = figures["runs"]
    assert unloaded["low_tokens_per_s"] is None and reserved["low_tokens_per_s"] > 0
    assert reserved["reserved_pages"] == 6 and no_reserve["reserved_pages"] == 0 and reserved["resizes"] == 0
    assert isinstance(figures["target_met"], bool)

    # The resizing run starts at the fixed run's 6 pages and follows high's demand, within its floor (one high
    # request's 2 pages) and ceiling.
    series = resizing["reserve_series"]
    assert resizing["resizes"] >= 1 and series[0][1] == 6 and len({pages for _, pages, _ in series}) >= 2
    assert all(resizing["reserved_floor"] == 2 <= pages <= resizing["reserved_ceiling"] for _, pages, _ in series)
    assert [t for t, _, _ in series] == sorted(t for t, _, _ in series)
    assert max(high for _, _, high in series) > 0
    assert [new for _, _, new, _ in resizing["reserve_resizes"]][-1] == series[-1][1]

    png = tmp_path / "reserve.png"
    plot_reserve(series, resizing["reserve_resizes"], resizing["kv_pages"], "tiny run", png)
    assert png.read_bytes().startswith(PNG_SIGNATURE)
