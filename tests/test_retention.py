"""Soft retention: a request's hint keeps its pages ahead of ordinary ones in eviction, then decays."""

from __future__ import annotations

import pytest

from fake_clock import FakeClock

from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.retention import Retention

ROOT = namespace_root("model-1", "alice")


def run(kv: KVCacheManager, seq: str, tokens: list[int], retention: Retention | None = None) -> list[int]:
    """A request that computes `tokens` (reusing what is cached) and finishes; returns its pages."""
    if retention is not None:
        kv.retain(seq, retention)
    hit = kv.find_prefix(ROOT, tokens)
    kv.adopt_prefix(seq, hit)
    kv.allocate_slots(seq, len(tokens) - hit.num_tokens)
    kv.commit(seq, ROOT, tokens, len(tokens))
    pages = kv.block_ids(seq)
    kv.free(seq, finished=True)
    return pages


def take(kv: KVCacheManager, n: int, seq: str) -> list[int]:
    kv.allocate_slots(seq, n * kv.block_size)
    return kv.block_ids(seq)


@pytest.mark.parametrize("shares", [True, False])
def test_retained_pages_go_last_then_decay(shares):
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=6, block_size=2, clock=clock, shares=CacheShares(enabled=shares))
    kept = run(kv, "doc", [1, 2, 3, 4, 0], Retention(priority=5, duration_s=60))[:2]  # released first
    plain = run(kv, "other", [5, 6, 7, 8, 0])[:2]
    assert kv.pool.num_retained_blocks == 2
    assert take(kv, 2, "a") == [2, 5]  # the never-used (partial) pages first
    # Least recently released would be the document; retained, it goes after the other prompt's pages.
    assert take(kv, 2, "b") == plain[::-1]
    kv.free("a", finished=True)
    kv.free("b", finished=True)
    assert kv.find_prefix(ROOT, [1, 2, 3, 4, 0]).num_tokens == 4  # still cached

    clock.advance(61)  # the hint ended: the document's pages are ordinary again
    kv.expire()
    assert kv.pool.num_retained_blocks == 0
    fresh = run(kv, "fresh", [9, 8, 7, 6, 0])[:2]  # released after the document
    assert take(kv, 3, "c")[-1] == kept[1]  # 2 never-used, then the document's tail: released longest ago
    assert kv.find_prefix(ROOT, [9, 8, 7, 6, 0]).block_ids == fresh


def test_higher_priority_outlasts_lower_and_a_touch_keeps_the_stronger_hint():
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=4, block_size=2, clock=clock)
    low = run(kv, "low", [1, 2, 3, 0], Retention(priority=1, duration_s=100))[0]
    high = run(kv, "high", [5, 6, 7, 0], Retention(priority=9, duration_s=10))[0]
    run(kv, "reuse", [5, 6, 7, 0])  # an ordinary request reuses the high one's page: its hint stays
    assert kv.pool.order.retained[high].priority == 9
    pages = take(kv, 4, "all")
    assert pages.index(low) < pages.index(high)  # among retained pages, the lower priority goes first


def test_a_preempted_sequence_keeps_its_hint_until_it_finishes():
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=4, block_size=2, clock=clock)
    kv.retain("s", Retention(priority=3, duration_s=30))
    kv.allocate_slots("s", 4)
    kv.commit("s", ROOT, [1, 2, 3, 4], 4)
    kv.free("s")  # preempted: it comes back
    assert kv.pool.num_retained_blocks == 2
    kv.free("s", finished=True)
    kv.allocate_slots("t", 2)
    kv.commit("t", ROOT, [9, 9], 2)
    kv.free("t", finished=True)
    assert kv.pool.num_retained_blocks == 2  # the finished "t" carried no hint


def test_a_hint_needs_a_priority_and_a_duration():
    with pytest.raises(ValueError):
        Retention(priority=0, duration_s=10)
    with pytest.raises(ValueError):
        Retention(priority=3, duration_s=0)
