"""`kvtierd bench tiers` at tiny sizes: every part runs on the bundled model, real LMDB files, a real
redis-server and a real daemon; each restored next turn starts from its tier's KV and gives the recomputed
turn's first token, and the tiers serve prompt tokens the device-only run recomputes."""

from __future__ import annotations

import shutil

import pytest
import torch
from daemon_fixtures import LOOKUP_WAIT_SHARE

from kvtierd.bench.tiers_bench import TiersFigures, TiersWorkload, run_tiers_bench
from kvtierd.storage.codecs import CODEC_NAMES

# Chunks of 4 pages: a 150-token prompt is 9 restorable pages, two whole chunks and a partial one.
# Two sessions of about 100 tokens on a device for one turn (the least it gets): each evicts the other's KV.
TINY = TiersWorkload(restore_tokens=150, restore_repeats=2, recompute_repeats=1, chunk_pages=4, bandwidth_chunks=3,
                     codec_repeats=1, sessions=2, history_tokens=32, rounds=2, reply_tokens=1, device_share=0.5,
                     host_share=0.5)


@pytest.fixture(scope="module")
def figures(loaded, tmp_path_factory, lookups_waited) -> TiersFigures:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine, 2 threads make each small step wait
    try:
        return run_tiers_bench(loaded, TINY, tmp_path_factory.mktemp("bench-tiers"), float(LOOKUP_WAIT_SHARE))
    finally:
        torch.set_num_threads(threads)


def test_a_next_turn_starts_from_each_tiers_kv_and_gives_the_recomputed_token(figures):
    r = figures.restore
    assert r.prompt_tokens == 150 and r.stored_tokens == 144 and r.chunks == 3 and r.recompute_ms > 0
    assert r.next_turn_tokens > r.prompt_tokens and r.raw_read_ms > 0
    assert [row.source for row in r.rows] == ["device", "host", "disk warm", "disk cold", "remote"]
    for row in r.rows:
        if row.source == "remote" and shutil.which("redis-server") is None:
            assert row.skipped and row.ttft_ms is None
            continue
        assert not row.skipped and row.same_first_token
        # The whole chunks come from the tier; the one-page tail chunk may be recomputed instead, when the
        # restore planner finds 16 more tokens in the step cheaper than a load (a slow remote on a busy host).
        assert row.loaded_tokens in (128, 144) and row.computed_tokens <= r.next_turn_tokens - 128
        assert row.ttft_ms > 0 and row.speedup == pytest.approx(r.recompute_ms / row.ttft_ms)


def test_through_the_daemon_a_session_resumes_after_a_restart_from_its_stored_kv(figures):
    d = figures.restore.daemon
    assert d is not None and d.same_reply
    assert d.cached_by_tier.get("host", 0) + d.cached_by_tier.get("disk", 0) > 150  # the first turn's KV, from below
    assert min(d.ttft_restored_ms, d.ttft_recompute_ms) > 0 and d.speedup == pytest.approx(
        d.ttft_recompute_ms / d.ttft_restored_ms)


def test_disk_bandwidth_beside_the_raw_disk(figures):
    b = figures.disk_bandwidth
    assert b.chunks == 3 and b.raw_write_GB_s > 0 and b.raw_read_cold_GB_s > 0
    planes, raw = b.rows
    assert (planes.codec, raw.codec) == ("zstd-planes", "raw") and b.auto_codec == "raw"  # float32 KV
    assert raw.stored_bytes > b.payload_bytes > planes.stored_bytes  # raw frames add a head; real KV compresses
    for row in b.rows:
        assert row.payload_equal
        assert min(row.write_GB_s, row.read_cold_GB_s, row.read_warm_GB_s) > 0
        assert row.write_share_of_raw == pytest.approx(row.write_GB_s / b.raw_write_GB_s)


def test_every_codec_round_trips_real_kv(figures):
    c = figures.codecs
    assert c.dtype == "float32" and c.chunks == 2
    assert [(row.codec, row.dtype) for row in c.rows] == [(name, dtype) for dtype in ("float32", "bfloat16")
                                                          for name in CODEC_NAMES]
    for dtype in ("float32", "bfloat16"):
        by_name = {row.codec: row for row in c.rows if row.dtype == dtype}
        assert by_name["raw"].ratio == 1.0 and by_name["zstd-planes"].ratio > 1.0
    assert all(row.exact and row.compress_GB_s > 0 and row.decompress_GB_s > 0 for row in c.rows)


def test_the_tiers_serve_what_the_device_only_run_recomputes(figures):
    ws = figures.working_set
    tiers, device_only = ws.runs
    assert (tiers.run, device_only.run) == ("tiers", "device only")
    for run in ws.runs:
        assert run.requests == 2 and run.prompt_tokens > 2 * 32
        assert 0 < run.ttft_p50_ms <= run.ttft_p95_ms
        assert sum(run.share_by_tier.values()) == pytest.approx(1.0)
    assert device_only.share_by_tier["host"] == device_only.share_by_tier["disk"] == 0
    assert tiers.share_by_tier["host"] + tiers.share_by_tier["disk"] > 0
    assert tiers.share_by_tier["computed"] < device_only.share_by_tier["computed"]
    assert ws.host_slots >= 1 and ws.ttft_p50_speedup > 0
    assert 0 < tiers.write_wait_s < tiers.wall_s and device_only.write_wait_s < device_only.wall_s
