"""`kvtierd bench startup` on the bundled model: both loads measured, the cached model equal, a fresh daemon
timed to its first token."""

from __future__ import annotations

from kvtierd.bench.startup_bench import run_startup_bench


def test_the_startup_bench_times_both_loads_of_one_model():
    f = run_startup_bench(None, repeats=1, processes=1)
    assert f.equal and f.repeats == 1 and f.entry_bytes > 100e6  # 135M float32 parameters, embeddings tied
    assert min(f.gguf_s, f.cached_s, f.convert_and_store_s) > 0 and f.speedup == f.gguf_s / f.cached_s
    assert f.processes == 1 and 0 < f.process_ready_s < f.process_first_token_s  # ready, then a request answered
    assert 0 < f.first_request_ttft_s <= f.process_first_token_s - f.process_ready_s  # sent once ready
