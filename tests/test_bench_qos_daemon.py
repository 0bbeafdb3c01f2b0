"""`kvtierd bench qos` at tiny sizes, through a real daemon: the runs asked for are there, every scheduled
high request is measured, and the figures have the right shape."""

from __future__ import annotations

import pytest

from kvtierd.bench.qos_bench import QosWorkload, run_qos_bench
from kvtierd.bench.report import machine
from kvtierd.bench.serve_bench import ServeBenchError


def test_unknown_runs_are_refused_before_a_daemon_starts():
    with pytest.raises(ServeBenchError, match="runs must be among"):
        run_qos_bench(QosWorkload(), ("qos", "fastest"))


def test_the_machine_line_names_the_cpu_and_torch():
    m = machine()
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] and m["torch_threads"] >= 1 and isinstance(m["isa"], list)


def test_qos_bench_measures_every_high_request_of_the_unloaded_and_qos_runs():
    w = QosWorkload(high_requests=3, high_every_s=0.3, high_prompt_tokens=12, high_reply_tokens=3, low_clients=1,
                    low_prompt_tokens=48, low_reply_tokens=2, head_start_s=1.0, kv_cache="32MiB")
    figures = run_qos_bench(w, ("unloaded", "qos"))
    unloaded, qos = figures["runs"]
    assert (unloaded["run"], qos["run"]) == ("unloaded", "qos")
    for r in (unloaded, qos):
        high = r["high"]
        assert high["requests"] == 3 and r["high_errors"] == 0
        assert 0 < high["ttft_p50_ms"] <= high["ttft_p95_ms"] <= high["ttft_p99_ms"]
        assert 0 < high["itl_p50_ms"] <= high["itl_p95_ms"] <= high["itl_p99_ms"]
    assert unloaded["low"] is None and unloaded["low_tokens_per_s"] is None and unloaded["ttft_p95_x"] == 1.0
    assert qos["low_tokens_per_s"] >= 0 and qos["low_errors"] == 0 and qos["ttft_p95_x"] > 0
    assert isinstance(figures["ttft_target_met"], bool) and "throughput_target_met" not in figures
