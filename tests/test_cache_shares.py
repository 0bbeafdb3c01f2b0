"""Cache shares: eviction takes first from the tenants above their weighted share of the cached pages."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.reserved_region import ReservedRegion

ROOT_A = namespace_root("model-1", "quiet")
ROOT_B = namespace_root("model-1", "noisy")


def manager(num_blocks: int, weights: dict[str, float], enabled: bool = True, **kw) -> KVCacheManager:
    shares = CacheShares(weights, enabled)
    shares.name(ROOT_A, "quiet")
    shares.name(ROOT_B, "noisy")
    return KVCacheManager(num_blocks=num_blocks, block_size=2, shares=shares, **kw)


def run(kv: KVCacheManager, seq: str, tokens: list[int], root: bytes) -> None:
    """A request that reuses what is cached of `tokens`, computes the rest and finishes."""
    hit = kv.find_prefix(root, tokens)
    kv.adopt_prefix(seq, hit)
    assert kv.allocate_slots(seq, len(tokens) - hit.num_tokens) is not None
    kv.commit(seq, root, tokens, len(tokens))
    kv.free(seq)


def cached_of(kv: KVCacheManager, root: bytes) -> int:
    return sum(page.root == root for _, page in kv.pool.cached_blocks())


@pytest.mark.parametrize("enabled", [True, False])
def test_a_flood_of_unique_prompts_evicts_its_own_pages_first(enabled):
    kv = manager(8, {}, enabled)
    run(kv, "doc", [1, 2, 3, 4, 5], ROOT_A)  # the quiet tenant's hot document: 2 pages
    for i in range(6):  # the noisy tenant: unique prompts of 2 pages each
        run(kv, f"n{i}", [100 + 10 * i + t for t in range(5)], ROOT_B)
    hit = kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5])
    counts = kv.pool.shares.counts_of(ROOT_A)
    if enabled:
        assert hit.num_tokens == 4 and counts.evictions == 0  # the flood took its own pages
        assert kv.pool.shares.counts_of(ROOT_B).evictions > 0
    else:
        assert hit.num_tokens == 0 and counts.evictions == 2 and counts.evictions_under_share == 2  # plain LRU


def test_weights_set_the_shares():
    kv = manager(12, {"quiet": 3.0})
    for i in range(3):
        run(kv, f"q{i}", [10 * i + t for t in range(5)], ROOT_A)  # 6 pages
    for i in range(6):
        run(kv, f"n{i}", [500 + 10 * i + t for t in range(5)], ROOT_B)
    # 11 cached pages at weights 3 : 1: the quiet tenant's share is 8.25; it holds 6 and loses none.
    assert cached_of(kv, ROOT_A) == 6 and cached_of(kv, ROOT_B) == 5  # (the last partial page is uncached)
    assert kv.pool.shares.share_pages(ROOT_A) == 11 * 3 / 4
    assert kv.pool.shares.counts_of(ROOT_A).evictions == 0


def test_a_tenant_under_its_share_loses_pages_when_nothing_else_can_go():
    kv = manager(6, {})
    run(kv, "doc", [1, 2, 3, 4, 5], ROOT_A)  # 2 idle pages
    # The noisy tenant holds 4 pages in a running request: above its share, but nothing of it is idle.
    kv.allocate_slots("running", 8)
    kv.commit("running", ROOT_B, list(range(50, 58)), 8)
    kv.allocate_slots("more", 2)  # only the quiet tenant's idle pages are left
    counts = kv.pool.shares.counts_of(ROOT_A)
    assert counts.evictions == 1 and counts.evictions_under_share == 1


# --- the state machine: two tenants, weights, pins and the reserved region ----------------------------------

class ShareMachine(RuleBasedStateMachine):
    """Random requests of two weighted tenants (reusing their prefixes, high or normal class), finishing,
    pins and unpins, on a tiny pool with a reserved region. Every page evicted for capacity is checked:
    its tenant was under its share only if no tenant above its share had an idle page."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = {"quiet": 1.0, "noisy": 2.0}
        self.kv = manager(10, self.weights, reserve=ReservedRegion(2, 2, 2), pin_budget_pages=3)
        self.held: dict[str, list[int]] = {}  # running sequence -> its tokens
        self.roots: dict[str, bytes] = {}
        self.pins: list[str] = []
        self.next_id = 0
        self.num_checked = 0
        pool = self.kv.pool
        evict = pool._evict_for_capacity

        def checked_evict(block_id: int) -> int:
            self._check_victim(pool.page_info(block_id).root)
            return evict(block_id)

        pool._evict_for_capacity = checked_evict

    def _check_victim(self, victim: bytes) -> None:
        pool = self.kv.pool
        cached = {ROOT_A: cached_of(self.kv, ROOT_A), ROOT_B: cached_of(self.kv, ROOT_B)}
        weight = {ROOT_A: self.weights["quiet"], ROOT_B: self.weights["noisy"]}
        total = sum(cached.values())
        weight_sum = sum(weight[r] for r in cached if cached[r])
        share = {r: total * weight[r] / weight_sum for r in cached}
        idle_roots = {pool.page_info(b).root for b in pool.idle_cached_blocks()}
        if cached[victim] < share[victim]:
            above = [r for r in idle_roots if r != victim and cached[r] > share[r]]
            assert not above, "a tenant under its share lost a page while another above its share had one idle"
        self.num_checked += 1

    @rule(root=st.sampled_from([ROOT_A, ROOT_B]), doc=st.integers(0, 3), length=st.integers(2, 9),
          high=st.booleans())
    def start(self, root, doc, length, high):
        seq = f"s{self.next_id}"
        self.next_id += 1
        tokens = [doc * 100 + t for t in range(length)]
        hit = self.kv.find_prefix(root, tokens)
        self.kv.adopt_prefix(seq, hit, high=high)
        if self.kv.allocate_slots(seq, length - hit.num_tokens, high=high) is None:
            self.kv.free(seq)
            return
        self.kv.commit(seq, root, tokens, length)
        self.held[seq], self.roots[seq] = tokens, root

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.held)))
        self.kv.free(seq)
        del self.held[seq], self.roots[seq]

    @rule(root=st.sampled_from([ROOT_A, ROOT_B]), doc=st.integers(0, 3))
    def pin(self, root, doc):
        pin_id = f"p{self.next_id}"
        self.next_id += 1
        try:
            self.kv.pin_prefix(pin_id, root, [doc * 100 + t for t in range(4)])
        except Exception:  # not cached, or over the pin budget: nothing pinned
            return
        self.pins.append(pin_id)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin_id = data.draw(st.sampled_from(self.pins))
        self.pins.remove(pin_id)
        self.kv.unpin(pin_id)

    def teardown(self):
        for seq in list(self.held):
            self.kv.free(seq)
        for pin_id in self.pins:
            self.kv.unpin(pin_id)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks


TestShareMachine = ShareMachine.TestCase
TestShareMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_the_host_tier_evicts_the_flooding_tenant_first():
    from kvtierd.storage.host_store import HostStore

    host = HostStore(capacity_bytes=6 * 128, slot_bytes=128)
    weights = {b"quiet": 1.0, b"noisy": 1.0}
    host.share_by(weights.__getitem__)

    def put(key: bytes, owner: bytes) -> None:
        host.write(key, 8, lambda out: out.fill_(1), owner=owner)

    put(b"doc-1", b"quiet")
    put(b"doc-2", b"quiet")
    for i in range(10):
        put(b"flood-%d" % i, b"noisy")
    assert host.contains_prefix([b"doc-1", b"doc-2"]) == 2  # 2 of 6 slots: under its share of 3
    assert host.slots_by_owner() == {b"quiet": 2, b"noisy": 4}
    assert host.contains_prefix([b"flood-9"]) == 1 and host.contains_prefix([b"flood-5"]) == 0  # its oldest went


def test_a_tenant_at_its_host_limit_replaces_its_own_chunks():
    from kvtierd.storage.host_store import HostStore

    host = HostStore(capacity_bytes=6 * 128, slot_bytes=128)
    host.limit_by({b"capped": 2 * 128}.get)  # [qos] tenant_limits host: 2 slots' worth
    host.write(b"other-1", 8, lambda out: out.fill_(1), owner=b"other")
    for i in range(5):
        host.write(b"capped-%d" % i, 8, lambda out: out.fill_(1), owner=b"capped")
    assert host.slots_by_owner() == {b"other": 1, b"capped": 2}  # free slots are left; its own oldest went
    assert host.contains_prefix([b"capped-3", b"capped-4"]) == 2 and host.contains_prefix([b"capped-2"]) == 0
    assert host.stats().num_evictions == 3
