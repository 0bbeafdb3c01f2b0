"""`kvtierd bench capacity`: the simulation's accounting on a small budget, and the allocators' rules."""

from __future__ import annotations

import dataclasses

import pytest

from kvtierd.bench.capacity_bench import CapacityWorkload, ExactFirstFit, SimRequest, make_requests, run_capacity_bench

SMALL = CapacityWorkload(budget_tokens=8192, window=1024, block_size=16, arrivals_per_step=0.5, steps=600,
                         warmup_steps=100, seed=1)


@pytest.fixture(scope="module")
def figures():
    return run_capacity_bench(SMALL)


def test_the_same_seeded_requests_for_every_allocator(figures):
    requests = make_requests(SMALL)
    assert requests == make_requests(SMALL) and len(requests) == figures.requests > 0
    assert all(16 <= r.prompt and 8 <= r.output and r.prompt + r.output <= SMALL.window for r in requests)
    assert [r.allocator for r in figures.rows] == ["paged 16", "full window", "first fit"]


def test_full_window_slots_hold_budget_over_window_sequences_and_waste_the_rest(figures):
    paged, window, first_fit = figures.rows
    assert window.running_p50 == SMALL.budget_tokens // SMALL.window  # overloaded: every slot busy
    assert window.held_share + window.wasted_share == pytest.approx(1.0)
    assert window.preemptions == first_fit.preemptions == 0  # both reserve a sequence's room up front
    assert paged.running_mean > first_fit.running_mean > window.running_mean
    assert paged.completed > window.completed


def test_paged_wastes_only_page_tails_and_first_fit_fragments(figures):
    paged, _, first_fit = figures.rows
    assert paged.wasted_share * SMALL.budget_tokens <= paged.running_mean * SMALL.block_size  # < a page a sequence
    assert paged.fragmented_share == 0 and paged.fragmentation_stalls == 0
    assert first_fit.fragmentation_stalls > 0 and first_fit.fragmented_share > 0


def test_first_fit_places_in_the_first_hole_big_enough_and_merges_freed_neighbours():
    ff = ExactFirstFit(dataclasses.replace(SMALL, budget_tokens=100, window=100))
    a, b, c = (SimRequest(i, 0, 20, 10) for i in range(3))  # 30 slots each
    assert ff.admit(a) and ff.admit(b) and ff.admit(c) and ff.holes == [(90, 10)]
    ff.free(b)
    assert ff.holes == [(30, 30), (90, 10)]
    big = SimRequest(3, 0, 30, 10)
    assert not ff.admit(big) and ff.unusable_free(big) == 40  # 40 free, no hole of 40
    ff.free(a)
    assert ff.holes == [(0, 60), (90, 10)] and ff.admit(big) and ff.ranges[3] == (0, 40)
