"""`kvtierd bench stall` at tiny sizes, through real daemons and a real redis-server: every scenario asked for
is measured with the streams running, and the table has its shape (no speed is asserted)."""

from __future__ import annotations

import shutil

import pytest

from kvtierd.bench.serve_bench import ServeBenchError
from kvtierd.bench.stall_bench import StallWorkload, run_stall_bench

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_unknown_scenarios_and_classes_are_refused_before_a_daemon_starts():
    with pytest.raises(ServeBenchError, match="scenarios must be among"):
        run_stall_bench(StallWorkload(scenarios=("disk", "tape")))
    with pytest.raises(ServeBenchError, match="priority must be one of high, normal, low"):
        run_stall_bench(StallWorkload(stream_priority="urgent"))


def test_stall_bench_measures_the_streams_around_each_load_and_the_next_turns(lookups_waited):
    w = StallWorkload(prompt_tokens=300, streams=2, stream_reply_tokens=16, head_start_s=2.0, kv_cache="64MiB",
                      scenarios=("disk", "remote slow"), turn_tokens=120, turn_later_s=0.5, turn_repeats=1,
                      load_repeats=2)
    f = run_stall_bench(w)
    assert f["machine"]["cores"] >= 1 and len(f["load_average"]) == 3
    disk, slow = f["scenarios"]
    assert (disk["scenario"], slow["scenario"]) == ("disk", "remote slow")
    # A whole chunk (256 tokens) of the prompt was stored; the disk run found it there (and loaded it, unless the
    # restore planner found recomputing cheaper).
    assert disk["restore"]["chunks_found"] >= 1
    assert disk["loaded_by_tier"].get("disk", 0) >= 256 or disk["restore"]["decision"] == "recompute"
    for r in (disk, slow):
        assert r["stream_errors"] == 0
        assert r["loads"] == len(r["ttft_load_all_ms"]) == len(r["ttft_recompute_all_ms"]) == \
            len(r["ttft_device_hit_all_ms"]) == 2
        assert r["ttft_load_ms"] > 0 and r["ttft_recompute_ms"] > 0 and r["ttft_device_hit_ms"] > 0
        assert r["window_ms"] == pytest.approx(r["ttft_load_ms"])
        # The same prompt sent again found its pages on the device, loaded or computed the first time.
        assert set(r["device_hit_by_tier"]) == {"device"} and r["device_hit_by_tier"]["device"] >= 256
        for window in (r["without_load"], r["with_load"], r["with_device_hit"], r["with_recompute"]):
            if window["gaps"]:
                assert 0 < window["p50_ms"] <= window["p99_ms"] <= window["max_ms"]
        assert 0 < r["baseline_window_ms"] <= r["window_ms"] + 1e-6
        # Each load's window without it is as long as its own, unless the quiet spell before it was shorter (a load
        # that ran past QUIET_SPELL_X times the longest before it): then the whole spell.
        assert r["baseline_window_all_ms"] == pytest.approx(
            [min(w, q) for w, q in zip(r["window_all_ms"], r["quiet_spell_all_ms"], strict=True)])
        assert r["ttft_warm_load_ms"] > 0 and len(r["with_load_max_all_ms"]) == len(r["without_load_max_all_ms"]) == 2
    turns = f["next_turn"]
    assert len(turns["right_after_all_ms"]) == len(turns["later_all_ms"]) == 1
    assert turns["x"] == pytest.approx(turns["right_after_ms"] / turns["later_ms"])
