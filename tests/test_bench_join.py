"""`kvtierd bench join`: a small run on the bundled model; the split join takes two steps, the whole one one."""

from __future__ import annotations

from kvtierd.bench.join_bench import run_join_bench


def test_a_small_join_bench_times_a_split_join_in_two_steps_and_a_whole_one_in_one():
    f = run_join_bench(context_len=200, streams=2, joins=2, kv_cache_bytes=64 << 20)
    assert f["context_len"] == 192 and f["plain_ms"] > 0
    assert f["split"]["steps"] == 2 and len(f["split"]["each_ms"]) == 2
    assert f["whole"]["steps"] == 1 and f["whole"]["longest_ms"] == f["whole"]["total_ms"]
    assert f["split"]["longest_ms"] <= f["split"]["total_ms"]
