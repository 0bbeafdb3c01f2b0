"""`kvtierd bench cpu-attention`: a small run over real kernels, checked against the reference first."""

from __future__ import annotations

import shutil

import pytest

from kvtierd.bench.cpu_attention_bench import run_cpu_attention_bench
from kvtierd.kernels.cpu_prefill import cpu_prefill_kernel


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_small_cpu_attention_bench_times_every_path():
    f = run_cpu_attention_bench(contexts=(40, 300), batches=(1, 2), num_layers=2, repeats=1)
    assert [(r["context_len"], r["batch_size"]) for r in f["rows"]] == [(40, 1), (40, 2), (300, 1), (300, 2)]
    for r in f["rows"]:
        assert min(r["decode_ms"], r["reference_ms"], r["decode_gbps"]) > 0
        assert r["kv_mb"] == 2 * 2 * r["batch_size"] * r["context_len"] * 3 * 64 * 2 / 1e6
        has_prefill = r["batch_size"] == 1 and cpu_prefill_kernel(64) is not None
        assert (r["prefill_kernel_ms"] is not None) == has_prefill
    assert f["read_gbps"] > 0
    assert f["join"]["context_len"] == 300 and f["join"]["decode_lens"] == [200, 180, 220]
    assert min(f["join"]["one_call_ms"], f["join"]["own_call_ms"]) > 0
    if cpu_prefill_kernel(64) is not None:  # both ways checked against the reference, then timed
        assert [(r["context_len"], r["num_tokens"]) for r in f["runs"]] == [(300, 4), (300, 16)]
        assert all(min(r["segments_ms"], r["whole_ms"]) > 0 for r in f["runs"])
