"""The reserved region and pins in the block pool, as specs and as random workloads.

Invariants: a lower-class allocation never leaves fewer free pages than the
unused reserve (and is refused only when it would); a pinned page is never
evicted, expired or handed out while pinned; a pin over the budget is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fake_clock import FakeClock
from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.pins import PinBudgetError, PinError
from kvtierd.cache.reserved_region import ReservedRegion

ROOT = namespace_root("model-1", "tenant-a")


def make_kv(num_blocks=10, reserve=None, pin_pages=0, ttl=0.0, clock=None) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=2, prefix_ttl_s=ttl, clock=clock or FakeClock(),
                          reserve=reserve, pin_budget_pages=pin_pages)


def compute(kv: KVCacheManager, seq: str, tokens: list[int], high: bool = False) -> bool:
    if kv.allocate_slots(seq, len(tokens), high) is None:
        return False
    kv.commit(seq, ROOT, tokens, len(tokens))
    return True


def test_lower_classes_leave_the_unused_reserve_to_high():
    kv = make_kv(10, ReservedRegion(4, 4, 4))
    assert kv.allocate_slots("low", 12) is not None  # 6 pages: 4 left, all reserved
    assert kv.allocate_slots("normal", 2) is None
    assert kv.allocate_slots("high", 8, high=True) is not None  # high takes the reserve
    assert kv.pool.num_free_blocks == 0


def test_pages_high_holds_count_against_the_reserve():
    kv = make_kv(10, ReservedRegion(4, 4, 4))
    assert kv.allocate_slots("high", 4, high=True) is not None  # 2 of the 4 reserved pages in use
    assert kv.pool.num_free_blocks_for(False) == 8 - 2
    kv.free("high")
    assert kv.pool.num_high_blocks == 0 and kv.pool.num_free_blocks_for(False) == 6


def test_the_reserve_follows_the_p99_of_high_demand_within_its_bounds():
    region = ReservedRegion(pages=4, floor=2, ceiling=20, window_s=10.0)
    assert region.observe(0.0, 10).new_pages == 15  # 1.5 x the demand
    assert region.observe(1.0, 40).new_pages == 20  # the ceiling
    assert region.observe(5.0, 38) is None  # already at the ceiling
    assert region.observe(16.0, 0).new_pages == 2  # a window without demand: down to the floor
    assert [(r.old_pages, r.new_pages) for r in region.history] == [(4, 15), (15, 20), (20, 2)]
    with pytest.raises(ValueError):
        ReservedRegion(pages=1, floor=2, ceiling=3)


def test_a_pinned_prefix_is_never_evicted_and_goes_when_unpinned():
    kv = make_kv(4, pin_pages=2)
    assert compute(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    pin = kv.pin_prefix("p1", ROOT, [1, 2, 3, 4])
    assert pin is not None and len(pin.block_ids) == 2
    assert kv.pool.num_free_blocks == 2
    assert kv.allocate_slots("b", 6) is None  # only 2 pages may go: the pinned ones stay
    assert kv.allocate_slots("b", 4) is not None
    kv.free("b")
    assert kv.find_prefix(ROOT, [1, 2, 3, 4, 5]).block_ids == pin.block_ids
    kv.unpin("p1")
    assert kv.pool.num_free_blocks == 4


def test_a_pin_survives_expiry_and_lapses_with_its_ttl():
    clock = FakeClock()
    kv = make_kv(4, pin_pages=4, ttl=5.0, clock=clock)
    assert compute(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    kv.pin_prefix("p1", ROOT, [1, 2], ttl_s=20.0)
    clock.advance(10.0)
    kv.expire()
    assert kv.find_prefix(ROOT, [1, 2, 3]).num_tokens == 2  # its page did not expire; the unpinned one did
    assert kv.find_prefix(ROOT, [1, 2, 3, 4, 5]).num_tokens == 2
    clock.advance(15.0)
    kv.expire()
    assert len(kv.pins) == 0 and kv.pool.num_pinned_blocks == 0


def test_a_pin_over_the_budget_is_refused_with_the_numbers():
    kv = make_kv(8, pin_pages=2)
    assert compute(kv, "a", [1, 2, 3, 4, 5, 6])
    with pytest.raises(PinBudgetError, match="pin budget of 2"):
        kv.pin_prefix("p1", ROOT, [1, 2, 3, 4, 5, 6])
    assert kv.pool.num_pinned_blocks == 0
    kv.pin_prefix("p1", ROOT, [1, 2, 3, 4])
    kv.pin_prefix("p2", ROOT, [1, 2])  # shares p1's first page: no new page
    with pytest.raises(PinError):
        kv.pin_prefix("p3", ROOT, [1])  # no full page
    assert kv.pin_prefix("p4", ROOT, [9, 9]) is None  # not cached: compute it first


def test_a_pinned_session_keeps_its_pool_and_follows_it():
    clock = FakeClock()
    kv = KVCacheManager(num_blocks=6, block_size=2, clock=clock, session_idle_ttl_s=5.0, pin_budget_pages=6)
    key = (ROOT, "s")
    assert compute(kv, "t1", [1, 2, 3])
    kv.keep_session("t1", key, [1, 2, 3], 3)
    kv.free("t1")
    kv.pin_session("p", key)
    assert kv.pool.num_pinned_blocks == 2
    clock.advance(10.0)
    kv.expire()
    assert kv.sessions.get(key) is not None  # pinned: its pool did not expire
    hit = kv.find_prefix(ROOT, [1, 2, 3, 4, 5], "s")
    kv.adopt_prefix("t2", hit)
    kv.allocate_slots("t2", 2)
    kv.keep_session("t2", key, [1, 2, 3, 4, 5], 5)
    kv.free("t2")
    assert kv.pool.num_pinned_blocks == 3 and kv.pins.get("p").block_ids == kv.sessions.get(key).block_ids


class QosPoolMachine(RuleBasedStateMachine):
    """Random high/lower allocations, frees, pins, unpins and expiry on a pool with a reserve; each
    lower-class allocation is checked against the unused reserve, and pinned pages against the shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.kv = make_kv(12, ReservedRegion(4, 4, 4), pin_pages=5, ttl=3.0, clock=self.clock)
        self.seqs: dict[str, tuple[list[int], bool]] = {}
        self.pinned: dict[str, list[int]] = {}  # pin id -> (page, generation) it was pinned at
        self.gens: dict[int, int] = {}
        self.n = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8), high=st.booleans(), reuse=st.booleans())
    def start(self, tokens, high, reuse):
        seq = f"s{self.n}"
        self.n += 1
        if reuse:
            self.kv.adopt_prefix(seq, self.kv.find_prefix(ROOT, tokens), high=high)
        pool = self.kv.pool
        table = self.kv.tables.get(seq)
        alloc = self.kv.allocate_slots(seq, len(tokens) - (table.num_tokens if table else 0), high)
        if alloc is None:
            self.kv.free(seq)
            return
        if not high:
            assert pool.num_free_blocks >= pool.reserve.unused(pool.num_high_blocks), "lower class ate the reserve"
        self.kv.commit(seq, ROOT, tokens, len(tokens))
        self.seqs[seq] = (tokens, high)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        del self.seqs[seq]
        self.kv.free(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=6))
    def pin(self, tokens):
        pin_id = f"p{self.n}"
        self.n += 1
        try:
            pin = self.kv.pin_prefix(pin_id, ROOT, tokens)
        except PinBudgetError:
            assert self.kv.pool.num_pinned_blocks + len(tokens) // 2 > 5  # refused only past the budget
            return
        if pin is not None:
            self.pinned[pin_id] = list(pin.block_ids)
            for b in pin.block_ids:
                self.gens[b] = self.kv.pool.generation[b]

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(sorted(self.pinned)))
        del self.pinned[pin_id]
        self.kv.unpin(pin_id)

    @rule(dt=st.sampled_from([1.0, 5.0]))
    def time_passes(self, dt):
        self.clock.advance(dt)
        self.kv.expire()

    @invariant()
    def pinned_pages_are_never_evicted_or_reused(self):
        pool = self.kv.pool
        for pages in self.pinned.values():
            for b in pages:
                assert pool.is_pinned(b) and pool.page_info(b) is not None, f"pinned page {b} was evicted"
                # Its contents never changed: no one was handed it (a holder's own writes bump it too,
                # but pinned pages are full, indexed and read-only).
                assert pool.generation[b] == self.gens[b], f"pinned page {b} was reused"
        assert pool.num_pinned_blocks <= 5

    @invariant()
    def counts_add_up(self):
        pool = self.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


TestQosPool = QosPoolMachine.TestCase
TestQosPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
