"""`kvtierd bench qos` at tiny sizes: every run is there, and the figures have the right shape."""

from __future__ import annotations

from kvtierd.bench.qos_bench import QosWorkload, run_qos_bench


def test_qos_bench_runs_every_scenario(loaded):
    w = QosWorkload(kv_pages=24, low_sessions=3, low_prompt_tokens=64, low_reply_tokens=8, high_requests=2,
                    high_prompt_tokens=20, high_reply_tokens=2, high_every_s=0.05)
    figures = run_qos_bench(loaded, w)
    assert [r["run"] for r in figures["runs"]] == ["unloaded", "reserved", "no reserve", "no qos"]
    for r in figures["runs"]:
        assert r["high_requests"] == 2 and 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"]
    assert figures["runs"][0]["low_tokens_per_s"] is None and figures["runs"][1]["low_tokens_per_s"] > 0
    assert figures["runs"][1]["reserved_pages"] == 6 and figures["runs"][2]["reserved_pages"] == 0
    assert isinstance(figures["target_met"], bool)
