"""`kvtierd bench serve` against the shared daemon: the figures have the right shape."""

from __future__ import annotations

import pytest

from kvtierd.bench.serve_bench import percentile, run_serve_bench, story_prompts


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_story_prompts_are_distinct_from_the_first_word():
    prompts = story_prompts(200, seed=1)
    assert len(set(prompts)) == 200
    assert prompts == story_prompts(200, seed=1)


def test_two_clients_one_request_each(daemon):
    figures = run_serve_bench(daemon.socket, clients=[2], requests_per_client=1, max_tokens=4, seed=0)
    assert figures["daemon"] == "external" and figures["model"]
    [level] = figures["levels"]
    assert level["clients"] == 2 and level["requests"] == 2
    assert 0 < level["output_tokens"] <= 2 * 4
    assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p95"]
    assert 0 < level["itl_ms_p50"] <= level["itl_ms_p95"]
    assert level["output_tok_s"] > 0 and level["req_s"] > 0
