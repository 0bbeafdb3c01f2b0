"""`kvtierd bench fleet` on a real redis-server: host B's hits come from the remote tier."""

from __future__ import annotations

from daemon_fixtures import LOOKUP_WAIT_SHARE
from kvtierd.bench.fleet_bench import run_fleet_bench


def test_a_short_fleet_bench_reuses_across_hosts(loaded, redis_server):
    f = run_fleet_bench(loaded, redis_server.url, doc_tokens=300, repeats=1, turns=1,
                        lookup_wait_share=float(LOOKUP_WAIT_SHARE))
    [shared] = f["shared_document"]
    assert shared["remote_tokens"] == shared["cached_tokens"] >= 256  # the whole chunk of the document
    assert f["session"]["remote_tokens"] > 0
    bw = f["bandwidth"]
    assert bw["chunks"] > 0 and bw["payload_bytes"] > bw["chunks"]
    assert min(bw["store_load_GB_s"], bw["store_load_raw_codec_GB_s"], bw["store_get_GB_s"], bw["raw_get_GB_s"], bw["raw_set_GB_s"]) > 0
