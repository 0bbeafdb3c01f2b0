"""`kvtierd bench reuse` at tiny sizes: the figures have the right shape, and the
prefix index computes fewer prefill tokens than recomputing every prompt."""

from __future__ import annotations

from kvtierd.bench.reuse_bench import document, questions, run_lookup_cost, run_multi_turn, run_shared_document


def test_document_is_deterministic_and_about_the_asked_size(loaded):
    doc = document(loaded.tokenizer, 100)
    assert doc == document(loaded.tokenizer, 100)
    assert 90 <= len(loaded.tokenizer.encode(doc)) <= 160
    assert len(set(questions(16))) == 16


def test_multi_turn_reuses_the_earlier_turns(loaded):
    figures = run_multi_turn(loaded, turns=2, doc_tokens=100, reply_tokens=4)
    first, second = figures["rows"]
    assert [first["turn"], second["turn"]] == [1, 2]
    assert first["cached_tokens"] == 0
    assert second["prompt_tokens"] > first["prompt_tokens"]
    # Every full page of turn 1's prompt is served from the cache in turn 2.
    assert second["cached_tokens"] >= first["prompt_tokens"] // 16 * 16
    assert all(r["ttft_cached_ms"] > 0 and r["ttft_recompute_ms"] > 0 for r in figures["rows"])
    assert figures["speedup_later_turns_median"] == figures["speedup_later_turns_min"] == second["speedup"]


def test_shared_document_computes_fewer_prefill_tokens_with_the_index(loaded):
    figures = run_shared_document(loaded, num_requests=3, doc_tokens=100)
    off, together, one_by_one = figures["runs"]
    assert (off["prefix_index"], together["prefix_index"], one_by_one["prefix_index"]) == (False, True, True)
    assert off["cached_tokens"] == 0 and off["requests_without_hit"] == 3
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] == off["forward_tokens"]
    # One by one, only the first request computes the document.
    assert one_by_one["requests_without_hit"] == 1
    assert one_by_one["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert one_by_one["fewer_prefill_x"] > 1
    # Three short prompts are admitted in one step, before any page is indexed: no sharing then.
    assert together["prefill_tokens_computed"] <= off["prefill_tokens_computed"]
    for r in figures["runs"]:
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["cached_tokens"] == r["forward_tokens"]
        assert r["wall_s"] > 0


def test_lookup_cost_on_a_fully_cached_prompt(loaded):
    figures = run_lookup_cost(loaded, num_tokens=100, repeats=50, hit_repeats=2)
    assert figures["tokens"] == 100 and figures["cached_tokens"] == 96
    assert 0 < figures["hash_us"] and 0 < figures["lookup_us"]
    assert 0 < figures["lookup_share_of_hit_ttft"] < 1
