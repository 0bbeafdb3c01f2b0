"""Eviction policies, expiry and invalidation: exact page ids on tiny pools, and
the page-accounting invariants under random workloads for every policy."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fake_clock import FakeClock

from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.eviction import EVICTION_POLICIES, make_policy
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.prefix_lookup import PrefixHit
from kvtierd.engine.config import EngineConfig

ROOT_A = namespace_root("model-1", "tenant-a")
ROOT_B = namespace_root("model-1", "tenant-b")
ROOT_P = namespace_root("model-1", "<public>")


def computed(kv: KVCacheManager, seq: str, tokens: list[int], root=ROOT_A) -> list[int]:
    """Allocates and commits `tokens` for a new sequence, as a step would; returns its pages."""
    kv.allocate_slots(seq, len(tokens))
    kv.commit(seq, root, tokens, len(tokens))
    return kv.block_ids(seq)


def reuse(kv: KVCacheManager, seq: str, tokens: list[int], root=ROOT_A) -> list[int]:
    """Runs a request that adopts the cached prefix of `tokens`, then finishes; returns the pages it hit."""
    hit = kv.find_prefix(root, tokens)
    kv.adopt_prefix(seq, hit)
    kv.allocate_slots(seq, len(tokens) - hit.num_tokens)
    kv.commit(seq, root, tokens, len(tokens))
    kv.free(seq)
    return hit.block_ids


def take_all(kv: KVCacheManager, seq: str = "taker") -> list[int]:
    """Allocates every free page to one sequence: the pages in the order allocation takes them."""
    kv.allocate_slots(seq, kv.num_free_blocks * kv.block_size)
    return kv.block_ids(seq)


# --- each policy's order ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,order", [
    ("lru", [3, 2, 1, 0, 4, 5]),  # released longest ago first: the hot chain 0-1 too
    ("lfu", [3, 2, 4, 5, 1, 0]),  # never hit first; the chain hit once last
    ("cost", [3, 2, 4, 5, 1, 0]),  # score 0 first (never hit), then 1 (2 = 1 x 2), then 0 (1 = 1 x 1)
])
def test_a_hot_chain_released_early(policy, order):
    kv = KVCacheManager(num_blocks=6, block_size=2, eviction_policy=policy)
    assert computed(kv, "a", [1, 2, 3, 4]) == [0, 1]
    kv.free("a")
    assert computed(kv, "b", [5, 6, 7, 8]) == [2, 3]
    kv.free("b")
    assert reuse(kv, "c", [1, 2, 3, 4, 9]) == [0, 1]  # one hit each; its partial page 4 comes back uncached
    assert computed(kv, "d", [11, 12, 13, 14]) == [5, 4]
    kv.free("d")
    assert kv.pool.num_cached_blocks == 6 and kv.pool.index.hits == {0: 1, 1: 1}
    assert take_all(kv) == order
    assert kv.pool.evictions.capacity == 6 and kv.pool.num_cached_blocks == 0


@pytest.mark.parametrize("policy,order", [
    ("lru", [2, 1, 0, 3]),
    ("lfu", [2, 1, 0, 3]),  # the chain was hit once, page 3 twice
    ("cost", [3, 2, 1, 0]),  # page 3: 2 x (1 + 0) = 2 < page 2: 1 x (1 + 2) = 3; then the chain tail first
])
def test_a_deep_chain_hit_once_against_a_shallow_page_hit_twice(policy, order):
    kv = KVCacheManager(num_blocks=8, block_size=2, eviction_policy=policy)
    assert computed(kv, "y", [3, 4, 5, 6, 7, 8]) == [0, 1, 2]
    kv.free("y")
    assert computed(kv, "x", [1, 2]) == [3]
    kv.free("x")
    assert reuse(kv, "y2", [3, 4, 5, 6, 7, 8, 9]) == [0, 1, 2]
    assert reuse(kv, "x2", [1, 2, 9]) == [3]
    assert reuse(kv, "x3", [1, 2, 9]) == [3]
    # Never-used pages (4..7, some released after the chains) go before any cached page.
    assert take_all(kv) == [7, 4, 5, 6] + order


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_chain_goes_tail_first_whatever_its_scores(policy):
    # Hit once each: cost scores 1, 2, 3 would take the head first; the tail must go first.
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
    computed(kv, "a", [1, 2, 3, 4, 5, 6])
    kv.free("a")
    assert reuse(kv, "b", [1, 2, 3, 4, 5, 6, 7]) == [0, 1, 2]
    assert take_all(kv) == [3, 2, 1, 0]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_chain_whose_head_went_idle_first_still_goes_tail_first(policy):
    # Two requests compute one prompt at once: "s1" indexes page 0 (the head),
    # "s2" page 3 (the tail, chained to page 0); s1 finishes first.
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
    kv.allocate_slots("s1", 4)
    kv.allocate_slots("s2", 4)
    kv.commit("s1", ROOT_A, [1, 2, 3, 4], 2)
    kv.commit("s2", ROOT_A, [1, 2, 3, 4], 4)
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5]).block_ids == [0, 3]
    kv.free("s1")  # head 0 idle
    kv.free("s2")  # tail 3 idle, released later
    assert kv.pool.idle_cached_blocks() == [0, 3]
    assert take_all(kv) == [1, 2, 3, 0]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_never_used_pages_go_before_any_cached_page(policy):
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
    computed(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    assert computed(kv, "b", [5, 6, 7]) == [2, 3]  # not the cached 1, 0
    kv.free("b")  # page 2 is cached now; page 3 (partial) is not
    assert take_all(kv) == [3, 1, 0, 2]  # page 3 although released last; then least recent


def test_the_policy_is_chosen_by_name():
    assert [make_policy(name).name for name in EVICTION_POLICIES] == ["lru", "lfu", "cost"]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="eviction_policy"):
        EngineConfig(eviction_policy="fifo")
    with pytest.raises(ValueError, match="prefix_ttl_s"):
        EngineConfig(prefix_ttl_s=-1.0)
    assert KVCacheManager(4, 2, "cost").pool.eviction_policy == "cost"


# --- expiry -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_an_idle_page_expires_after_the_ttl_without_a_use(policy):
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy, prefix_ttl_s=10.0, clock=clock)
    computed(kv, "a", [1, 2, 3, 4])
    kv.free("a")  # t = 0
    clock.now = 9.5
    assert reuse(kv, "b", [1, 2, 3, 4, 5]) == [0, 1]  # a use restarts the clock
    clock.now = 19.4
    assert reuse(kv, "c", [1, 2, 3, 4, 5]) == [0, 1]
    clock.now = 29.4
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5]).block_ids == []  # a miss, and the chain is evicted
    assert kv.pool.num_cached_blocks == 0 and kv.pool.evictions.expired == 2
    assert kv.num_free_blocks == 4
    assert take_all(kv)[:2] == [1, 0]  # first in line for reuse


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_page_in_use_never_expires(policy):
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=6, block_size=2, eviction_policy=policy, prefix_ttl_s=10.0, clock=clock)
    computed(kv, "a", [1, 2, 3])  # held from t = 0
    clock.now = 100.0
    assert kv.expire() == 0
    assert reuse(kv, "b", [1, 2, 3]) == [0]
    kv.free("a")  # idle from t = 100
    clock.now = 109.9
    assert kv.find_prefix(ROOT_A, [1, 2, 3]).block_ids == [0]
    clock.now = 110.0
    assert kv.find_prefix(ROOT_A, [1, 2, 3]).block_ids == [] and kv.pool.evictions.expired == 1


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_expire_sweeps_the_oldest_idle_pages_a_few_at_a_time(policy):
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=6, block_size=2, eviction_policy=policy, prefix_ttl_s=10.0, clock=clock)
    for t, seq, tokens in [(0.0, "a", [1, 2]), (1.0, "b", [3, 4]), (2.0, "c", [5, 6])]:
        clock.now = t
        computed(kv, seq, tokens)
        kv.free(seq)
    assert kv.pool.idle_cached_blocks() == [0, 1, 2]
    assert kv.pool.expire(11.5, max_pages=1) == 1  # bounded work per call
    assert kv.pool.idle_cached_blocks() == [1, 2]
    clock.now = 11.5
    assert kv.expire() == 1  # page 2 has been idle 9.5 s only
    assert kv.pool.idle_cached_blocks() == [2] and kv.pool.evictions.expired == 2
    assert kv.expire(12.0) == 1 and kv.pool.num_cached_blocks == 0
    assert kv.pool.evictions.capacity == kv.pool.evictions.invalidated == 0


def test_no_ttl_means_pages_never_expire():
    clock = FakeClock(0.0)
    kv = KVCacheManager(num_blocks=4, block_size=2, clock=clock)
    computed(kv, "a", [1, 2, 3])
    kv.free("a")
    clock.now = 1e9
    assert kv.expire() == 0 and kv.find_prefix(ROOT_A, [1, 2, 3]).block_ids == [0]


# --- invalidation -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_invalidating_a_namespace_drops_its_pages_and_spares_the_others(policy):
    kv = KVCacheManager(num_blocks=8, block_size=2, eviction_policy=policy)
    assert computed(kv, "a", [1, 2, 3, 4]) == [0, 1]  # in use
    assert computed(kv, "idle", [5, 6, 7, 8]) == [2, 3]
    kv.free("idle")
    assert computed(kv, "b", [1, 2, 3, 4], ROOT_B) == [4, 5]
    kv.free("b")

    assert kv.invalidate_namespace(ROOT_A) == 4
    assert kv.pool.evictions.invalidated == 4 and kv.pool.num_cached_blocks == 2
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 9]).block_ids == []
    assert kv.find_prefix(ROOT_A, [5, 6, 7, 8, 9]).block_ids == []
    assert kv.find_prefix(ROOT_B, [1, 2, 3, 4, 9]).block_ids == [4, 5]
    # "a" keeps its pages; they come back uncached, after the dropped idle ones (first in line).
    assert kv.block_ids("a") == [0, 1] and kv.pool.ref_count(0) == kv.pool.ref_count(1) == 1
    kv.allocate_slots("a", 1)  # a page for token 5
    kv.commit("a", ROOT_A, [1, 2, 3, 4, 5, 6], 6)  # its new page 3 is not indexed: the chain's head is gone
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7]).block_ids == []
    kv.free("a")
    assert take_all(kv) == [2, 6, 7, 3, 1, 0, 5, 4]  # ROOT_B's chain last, tail first


# --- random workloads, under each policy ----------------------------------------------------------------------

class EvictionMachine(RuleBasedStateMachine):
    """Random start (reusing cached prefixes of two tenants and the public namespace,
    and two sessions' context pools) / append / fork / free, with time passing, expiry,
    and invalidation by namespace, prefix, tag and session, on a tiny pool. A shadow of
    the device checks that a sequence reads back exactly its tokens and that a lookup
    only ever serves pages holding the tokens asked for (session pools keep pages they
    do not hold, which others may write); a recorder on the pool checks what each
    allocation took: never-used pages first, and a cached page never before an idle
    page that follows it in its chain."""

    policy = "lru"
    shares = False  # on: one policy per tenant, the tenant furthest above its share first (cache/cache_shares.py)
    TTL = 5.0

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(0.0)
        shares = CacheShares({"tenant-b": 2.0}, self.shares)
        shares.name(ROOT_B, "tenant-b")
        self.kv = KVCacheManager(num_blocks=8, block_size=3, eviction_policy=self.policy,
                                 prefix_ttl_s=self.TTL, clock=self.clock, public_root=ROOT_P, shares=shares)
        self.cells: dict[int, int] = {}  # slot -> token id: the "device"
        self.history: dict[str, list[int]] = {}
        self.roots: dict[str, bytes] = {}
        self.sessions: dict[str, str] = {}  # sequence -> its session
        self.next_id = 0
        pool = self.kv.pool
        allocate = pool.allocate

        def checked_allocate(n: int, high: bool = False) -> list[int] | None:
            idle = {b: pool.page_info(b) for b in pool.idle_cached_blocks()}
            num_uncached = pool.num_free_blocks - len(idle)
            taken = allocate(n, high)
            if taken is not None:
                self._check_taken(taken, idle, num_uncached)
            return taken

        pool.allocate = checked_allocate

    def _check_taken(self, taken, idle, num_uncached) -> None:
        kinds = ["cached" if b in idle else "never-used" for b in taken]
        assert kinds.count("never-used") == min(len(taken), num_uncached)
        assert kinds == sorted(kinds, key=lambda k: k == "cached")  # never-used ones first
        for i, b in enumerate(taken):
            if b in idle:
                page = idle[b]
                followers = [c for c, p in idle.items()
                             if p.parent_hash == page.block_hash and p.depth == page.depth + 1]
                assert all(c in taken[:i] for c in followers), f"page {b} evicted before its tail {followers}"

    def _write(self, seq: str, tokens: list[int]) -> bool:
        alloc = self.kv.allocate_slots(seq, len(tokens))
        if alloc is None:
            return False
        bs = self.kv.block_size
        for src, dst in alloc.copies:
            for off in range(bs):
                if (src * bs + off) in self.cells:
                    self.cells[dst * bs + off] = self.cells[src * bs + off]
        for slot, t in zip(alloc.slots, tokens):
            self.cells[slot] = t
        self.history[seq] = self.history.get(seq, []) + tokens
        self.kv.commit(seq, self.roots[seq], self.history[seq], len(self.history[seq]))
        return True

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9), root=st.sampled_from([ROOT_A, ROOT_B, ROOT_P]),
          reuse=st.booleans(), session=st.sampled_from([None, "x", "y"]), tag=st.sampled_from([None, "doc:v1"]))
    def start(self, tokens, root, reuse, session, tag):
        """A request; one that does not reuse (prefix caching off, or admitted beside
        one computing the same prompt) makes a chain whose pages come from two requests."""
        self._start(tokens, root, reuse, session, tag)

    @rule(root=st.sampled_from([ROOT_A, ROOT_B]), session=st.sampled_from(["x", "y"]), keep=st.integers(0, 12),
          new=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def next_turn(self, root, session, keep, new):
        """A session's next turn: its kept tokens (cut short: an edited history) and new ones."""
        chain = self.kv.sessions.get((root, session))
        if chain is not None:
            self._start(list(chain.token_ids[:keep]) + new, root, True, session, None)

    def _start(self, tokens, root, reuse, session, tag):
        seq = f"s{self.next_id}"
        self.next_id += 1
        hit = self.kv.find_prefix(root, tokens, session) if reuse else PrefixHit([], [], 0)
        bs, pool = self.kv.block_size, self.kv.pool
        served = [self.cells[hit.block_ids[p // bs] * bs + p % bs] for p in range(hit.num_tokens)]
        assert served == tokens[: hit.num_tokens], "a lookup served pages holding other tokens"
        for b in hit.block_ids:
            page = pool.page_info(b)
            if hit.source == "session":
                assert page is None or page.root in (root, ROOT_P)
                continue
            assert page.root in (root, ROOT_P) and (page.root == root or hit.source == "public")
            assert pool.ref_count(b) > 0 or self.clock.now - pool.index.last_access[b] < self.TTL, "served an expired page"
        self.kv.adopt_prefix(seq, hit, tag)
        self.roots[seq] = root
        if session is not None:
            self.sessions[seq] = session
        self.history[seq] = tokens[: hit.num_tokens]
        if not self._write(seq, tokens[hit.num_tokens :]):
            self.kv.free(seq)
            del self.history[seq], self.roots[seq]
            self.sessions.pop(seq, None)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(sorted(self.history)))
        self._write(seq, tokens)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.history)))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent, child)
        self.history[child] = list(self.history[parent])
        self.roots[child] = self.roots[parent]

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def finish_or_cancel(self, data):
        seq = data.draw(st.sampled_from(sorted(self.history)))
        session = self.sessions.pop(seq, None)
        if session is not None:
            self.kv.keep_session(seq, (self.roots[seq], session), self.history[seq], len(self.history[seq]))
        self.kv.free(seq)
        del self.history[seq], self.roots[seq]

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def time_passes(self, dt):
        self.clock.now += dt

    @rule()
    def expire(self):
        self.kv.expire()
        pool = self.kv.pool
        assert all(self.clock.now - pool.index.last_access[b] < self.TTL for b in pool.idle_cached_blocks())

    @rule(root=st.sampled_from([ROOT_A, ROOT_B, ROOT_P]))
    def invalidate(self, root):
        self.kv.invalidate_namespace(root)
        assert all(page.root != root for _, page in self.kv.pool.cached_blocks())

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def invalidate_prefix(self, data):
        seq = data.draw(st.sampled_from(sorted(self.history)))
        root, tokens = self.roots[seq], self.history[seq] + [0]
        before = len(self.kv.find_prefix(root, tokens).block_hashes)  # the history's full pages it hits
        self.kv.invalidate_prefix(root, self.history[seq])
        after = self.kv.find_prefix(root, tokens)
        # its last full page went (shared ones may stay); a page of other tokens holding it all may be hit
        assert after.source != "prefix" or len(after.block_hashes) < before or before == 0

    @rule()
    def invalidate_tag(self):
        self.kv.invalidate_tag("doc:v1")
        assert not any("doc:v1" in tags for tags in self.kv.pool.index.tags.values())

    @rule(root=st.sampled_from([ROOT_A, ROOT_B, ROOT_P]), session=st.sampled_from(["x", "y"]))
    def invalidate_session(self, root, session):
        self.kv.invalidate_session((root, session))
        assert self.kv.find_prefix(root, [0] * 9, session).source != "session"

    @invariant()
    def each_sequence_sees_only_its_own_tokens(self):
        for seq, expected in self.history.items():
            table = self.kv.table(seq)
            assert table.num_tokens == len(expected)
            assert [self.cells[s] for s in table.slots(0, table.num_tokens)] == expected

    @invariant()
    def ref_counts_match_the_page_tables(self):
        counts = [0] * self.kv.pool.num_blocks
        for seq in self.history:
            for b in self.kv.block_ids(seq):
                counts[b] += 1
        assert all(self.kv.pool.ref_count(b) == counts[b] >= 0 for b in range(len(counts)))
        assert self.kv.num_free_blocks == counts.count(0)
        idle = self.kv.pool.idle_cached_blocks()
        assert all(counts[b] == 0 and self.kv.pool.page_info(b) is not None for b in idle)

    def teardown(self):
        for seq in list(self.history):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks  # no page leaked


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None)


class LRUMachine(EvictionMachine):
    policy = "lru"


class LFUMachine(EvictionMachine):
    policy = "lfu"


class CostMachine(EvictionMachine):
    policy = "cost"


class SharedLFUMachine(EvictionMachine):
    policy = "lfu"
    shares = True


TestLRU = LRUMachine.TestCase
TestLFU = LFUMachine.TestCase
TestCost = CostMachine.TestCase
TestSharedLFU = SharedLFUMachine.TestCase
for _case in (TestLRU, TestLFU, TestCost, TestSharedLFU):
    _case.settings = MACHINE_SETTINGS
del _case  # else pytest collects the loop variable as one more test class
