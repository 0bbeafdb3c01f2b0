"""`kvtierd bench tenants` with tiny parameters: every run is there, with hits by tier and TTFT."""

from __future__ import annotations

from kvtierd.bench.tenants_bench import TenantsWorkload, run_tenants_bench


def test_the_bench_reports_each_run_and_the_targets(loaded):
    w = TenantsWorkload(kv_pages=24, host_pages=16, docs=1, doc_tokens=48, sessions=1, turn_tokens=16, rounds=3,
                        noisy_per_round=1, noisy_tokens=64, reply_tokens=2)
    f = run_tenants_bench(loaded, w)
    assert [(r["run"], r["host_tier"]) for r in f["runs"]] == [
        (run, host) for host in (False, True) for run in ("alone", "no shares", "shares")]
    for r in f["runs"]:
        assert r["quiet_prompt_tokens"] > 0 and 0 <= r["device_hit_rate"] <= r["memory_hit_rate"] <= 1
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"]
        assert r["noisy_prompts"] == (0 if r["run"] == "alone" else 3)
        if not r["host_tier"]:
            assert r["host_hit_rate"] == 0
    alone = f["runs"][0]
    assert alone["device_hit_rate"] > 0  # round 2 asks the document of round 0 again
    assert set(f["targets"]) == {"device_hits_host_off", "memory_hits_host_on"}
    assert all(isinstance(met, bool) for met in f["targets"].values())  # alone had hits to compare with
    assert set(f["ttft_split_p50"]) == {"host off", "host on"}
