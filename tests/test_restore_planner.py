"""The restore planner: load the leading chunks whose cumulative saving over recomputing is largest."""

from __future__ import annotations

import random

import pytest

from kvtierd.engine.step_cost import StepCost, StepCostModel, StepShape
from kvtierd.tiers.restore_planner import LOADS_AHEAD, ChunkCost, LoadCost, RestorePlanner

MB = 1 << 20


def planner(host_bps: float | None = None, remote_bps: float | None = None, prefill_tps: float | None = None):
    p = RestorePlanner()
    if host_bps:
        p.observe_load("host", int(host_bps), 1.0)
    if remote_bps:
        p.observe_load("remote", int(remote_bps), 1.0)
    if prefill_tps:
        p.recompute_cost = lambda tokens: tokens / prefill_tps
    return p


def chunk(tier: str, mb: int = 12, tokens: int = 256) -> ChunkCost:
    return ChunkCost(tier, mb * MB, tokens)


def test_until_both_rates_are_measured_everything_is_loaded() -> None:
    chunks = [chunk("host"), chunk("remote")]
    for p in (planner(), planner(host_bps=1e9, remote_bps=1e9), planner(prefill_tps=1e9)):
        plan = p.plan(chunks)
        assert (plan.num_chunks, plan.decision) == (2, "load")


def test_a_slow_cpu_prefill_loads_everything() -> None:
    plan = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=500).plan([chunk("host"), chunk("remote")])
    assert plan.decision == "load"
    assert plan.load_s == pytest.approx((12 * MB / 3e9 + 12 * MB / 1e8) / LOADS_AHEAD)  # side by side
    assert plan.recompute_s == pytest.approx(512 / 500)


def test_fast_prefill_recomputes_instead_of_a_slow_remote_load() -> None:
    # 256 tokens at 20k tok/s: 12.8 ms; 12 MB from host at 3 GB/s: 4.2 ms, from remote at 0.1 GB/s: 126 ms.
    p = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=20_000)
    plan = p.plan([chunk("host"), chunk("host"), chunk("remote")])
    assert (plan.num_chunks, plan.decision) == (2, "partial")
    plan = p.plan([chunk("remote"), chunk("host")])  # host after remote: the remote chunk is needed first
    assert (plan.num_chunks, plan.decision) == (0, "recompute")
    assert p.decisions == {"partial": 1, "recompute": 1}


def test_a_later_saving_can_pay_for_an_earlier_loss() -> None:
    # A small remote chunk that loses a little, then host chunks that win more: load all.
    p = planner(host_bps=3e9, remote_bps=1e8, prefill_tps=20_000)
    plan = p.plan([chunk("remote", mb=1, tokens=32), chunk("host"), chunk("host")])
    assert plan.decision == "load"


def test_nothing_found_is_not_a_decision() -> None:
    p = planner()
    assert p.plan([]).decision == "none" and not p.decisions


def test_a_tier_costs_a_latency_plus_its_bytes_once_loads_of_two_sizes_are_seen() -> None:
    p = RestorePlanner()
    p.observe_load("disk", 10 * MB, 0.1)
    assert p.load_costs()["disk"].seconds(20 * MB) == pytest.approx(0.2)  # one size: a rate
    p.observe_load("disk", MB, 0.019)  # 10 ms + 9 ms per MB
    cost = p.load_costs()["disk"]
    assert cost.latency_s == pytest.approx(0.01) and cost.byte_s * MB == pytest.approx(0.009)
    p.observe_load("remote", 0, 1.0)  # nothing loaded: nothing learned
    assert p.load_costs().keys() == {"disk"}
    assert p.rates() == ({"disk": pytest.approx(MB / 0.009)}, None)  # no recompute cost given


def test_a_fixed_cost_is_not_mistaken_for_a_slow_tier() -> None:
    """Loads whose size changes nothing (noise around a round trip): a latency, not a negative bandwidth."""
    p = RestorePlanner()
    p.observe_load("remote", MB, 0.012)
    p.observe_load("remote", 10 * MB, 0.010)
    assert p.load_costs()["remote"] == LoadCost(pytest.approx(0.011, rel=0.01), 0.0)


def test_estimates_are_within_2x_of_what_a_realistic_mix_costs() -> None:
    """The engine's step-cost fit and the planner's load fits, fed a day's mix (small and large prefills
    with decodes riding along, loads of one page and of whole chunks from each tier), estimate a session's
    2,416-token turn and loads of several sizes within 2x of their true costs. No clocks: the costs are
    synthetic, from a model of the machine with attention growing with the context."""
    rng = random.Random(7)
    overhead, per_token, per_decode, per_context = 0.07, 1.2e-3, 1.5e-3, 2e-7

    def step_s(prefill: int, context: int, decodes: int) -> float:  # what the machine takes
        return overhead + prefill * (per_token + per_context * (context + prefill / 2)) + decodes * per_decode

    bandwidth = {"host": (2e-4, 4e9), "disk": (2e-3, 1.5e9), "remote": (1e-3, 0.4e9)}  # latency, bytes/s

    def load_s(tier: str, nbytes: int) -> float:
        latency, bps = bandwidth[tier]
        return latency + nbytes / bps

    costs, planner = StepCostModel(), RestorePlanner()
    step_tokens = 2048
    planner.recompute_cost = lambda tokens: costs.current.prefill_seconds(tokens, step_tokens)
    for _ in range(300):
        decodes = rng.randint(0, 6)
        prefill, context = rng.choice([(0, 0), (0, 0), (16, 0), (40, 300), (200, 0), (900, 0), (2048, 1500)])
        noise = rng.uniform(0.85, 1.15)
        costs.observe(StepShape(prefill, decodes), step_s(prefill, context, decodes) * noise)
        tier = rng.choice(list(bandwidth))
        nbytes = rng.choice([1, 3, 16]) * 737_280  # a page is 737 KB: 1 or 3 of a chunk's tail, or 16
        planner.observe_load(tier, nbytes, load_s(tier, nbytes) * rng.uniform(0.85, 1.15))

    def within_2x(estimate: float, true: float) -> bool:
        return true / 2 <= estimate <= true * 2

    turn = 2416  # computed alone, in steps of at most step_tokens
    true_turn = sum(step_s(min(step_tokens, turn - done), done, 0) for done in range(0, turn, step_tokens))
    assert within_2x(planner.recompute_s(turn), true_turn)
    assert within_2x(planner.recompute_s(64), step_s(64, 0, 0))
    for tier in bandwidth:
        for pages in (1, 16, 151):  # a tail, a chunk, a whole 2,416-token turn's pages
            nbytes = pages * 737_280
            assert within_2x(planner.load_costs()[tier].seconds(nbytes), load_s(tier, nbytes)), (tier, pages)
    plan = planner.plan([ChunkCost("disk", 16 * 737_280, 256)] * 9 + [ChunkCost("disk", 7 * 737_280, 112)])
    assert plan.decision == "load"
    # Its loads run LOADS_AHEAD at a time, side by side (an idle engine's restore; beside running requests they
    # take turns, and each observed time holds the other's turns).
    assert within_2x(plan.load_s, (9 * load_s("disk", 16 * 737_280) + load_s("disk", 7 * 737_280)) / LOADS_AHEAD)
    assert within_2x(plan.recompute_s, sum(step_s(min(step_tokens, 2416 - d), d, 0) for d in range(0, 2416, 2048)))


def test_a_requests_loads_overlap_loads_ahead_at_a_time() -> None:
    """A far Redis: each load waits its 0.3 s round trip, and the two in flight wait theirs together."""
    p = planner(remote_bps=12 * MB / 0.35, prefill_tps=1000)  # a 12 MB chunk: 0.35 s; 256 tokens: 0.256 s
    assert p.plan([chunk("remote")]).decision == "recompute"  # one load alone: 0.35 s against 0.256
    plan = p.plan([chunk("remote")] * 10)  # 3.5 s of loads, two at a time: 1.75 s against 2.56
    assert plan.decision == "load" and plan.load_s == pytest.approx(1.75)


def test_a_recompute_beside_decodes_counts_their_steps() -> None:
    """Beside decoding streams a prompt goes in smaller steps (`prefill_chunk_beside_decodes`), each with the
    decodes in it: its recompute pays every one of those steps, not two steps of its own."""
    cost = StepCost(overhead_s=0.01, prefill_token_s=1e-3, decode_token_s=2e-3)
    assert cost.prefill_seconds(512, 2048) == pytest.approx(0.01 + 0.512)
    assert cost.prefill_seconds(512, 256, StepShape(0, 3, 0)) == pytest.approx(2 * (0.01 + 0.256 + 3 * 2e-3))
