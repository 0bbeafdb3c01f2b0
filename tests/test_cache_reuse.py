"""Session context pools, public prefixes, tags, invalidation and expiry in the
cache layer: exact page ids on tiny pools (block size 4)."""

from __future__ import annotations

import pytest

from fake_clock import FakeClock

from kvtierd.cache.block_hash import hash_full_blocks, namespace_root, rebase
from kvtierd.cache.eviction import EVICTION_POLICIES
from kvtierd.cache.kv_cache_manager import KVCacheManager

ROOT_A = namespace_root("model-1", "tenant-a")
ROOT_B = namespace_root("model-1", "tenant-b")
ROOT_P = namespace_root("model-1", "<public>")


def manager(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=4, public_root=ROOT_P, **kw)


def turn(kv: KVCacheManager, seq: str, tokens: list[int], root=ROOT_A, session: str | None = None,
         tag: str | None = None, keep: bool = True):
    """One request: adopts what the cache has, computes the rest, keeps its session pool, finishes.
    Returns the hit and the copies made before writing."""
    hit = kv.find_prefix(root, tokens, session)
    kv.adopt_prefix(seq, hit, tag)
    alloc = kv.allocate_slots(seq, len(tokens) - hit.num_tokens)
    kv.commit(seq, root, tokens, len(tokens), tag)
    if session is not None and keep:
        kv.keep_session(seq, (root, session), tokens, len(tokens))
    kv.free(seq)
    return hit, alloc.copies


# --- session context pools --------------------------------------------------------------------------------------

def test_a_session_turn_reuses_its_partly_filled_last_page():
    kv = manager()
    turn(kv, "t1", [1, 2, 3, 4, 5, 6], session="s")  # page 0 full (indexed), page 1 holds 5, 6
    hit, copies = turn(kv, "t2", [1, 2, 3, 4, 5, 6, 7, 8, 9], session="s")
    assert (hit.source, hit.block_ids, hit.num_tokens) == ("session", [0, 1], 6)
    assert copies == []  # page 1 is nobody else's and not indexed: written in place
    # Without the session, the prefix index has the full page only.
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 8  # t2 filled page 1
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 0]).num_tokens == 4


def test_an_edited_history_reuses_the_pool_up_to_the_first_differing_token():
    kv = manager()
    turn(kv, "t1", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], session="s")  # pages 0, 1 full; page 2 partial
    hit, copies = turn(kv, "t2", [1, 2, 3, 4, 5, 6, 0, 0, 0], session="s")
    assert (hit.block_ids, hit.num_tokens) == ([0, 1], 6)
    assert copies == [(1, 3)]  # page 1 is indexed: the edit goes into a private copy
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7, 8, 9]).block_ids == [0, 1]  # the original is intact


def test_a_session_page_reused_by_someone_else_is_not_served():
    kv = manager(num_blocks=3)
    turn(kv, "t1", [1, 2, 3, 4, 5, 6], session="s")  # page 0 (indexed), page 1 (tail, free)
    kv.allocate_slots("other", 4)  # takes never-used page 2 ...
    kv.allocate_slots("other", 4)  # ... then the session's tail page 1
    assert kv.block_ids("other") == [2, 1]
    hit = kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7], "s")
    assert hit.num_tokens == 4 and hit.block_ids == [0]  # the full page is still good


def test_sessions_never_cross_tenants():
    kv = manager()
    turn(kv, "t1", [1, 2, 3, 4, 5, 6], session="s")
    assert kv.find_prefix(ROOT_B, [1, 2, 3, 4, 5, 6, 7], "s").num_tokens == 0


def test_an_idle_session_expires_and_takes_only_its_own_pages():
    clock = FakeClock(0.0)
    kv = manager(session_idle_ttl_s=60, clock=clock)
    doc = [9, 9, 9, 9, 8, 8, 8, 8]
    turn(kv, "other", doc + [1], session=None)  # pages 0, 1 indexed; its tail page 2 freed
    turn(kv, "t1", doc + [5, 5, 5, 5, 6], session="s")  # adopts 0, 1; page 3 full; tail page 2 or 4
    clock.now = 59
    assert kv.expire() == 0
    clock.now = 61
    assert kv.expire() == 1  # page 3, the session's own; the shared document stays
    assert kv.find_prefix(ROOT_A, doc + [5, 5, 5, 5, 6], "s").num_tokens == 8
    assert kv.pool.evictions.expired == 1 and len(kv.sessions) == 0


# --- public prefixes ------------------------------------------------------------------------------------------------

def test_a_public_prefix_is_shared_and_what_follows_it_is_not():
    kv = manager()
    system = [7, 7, 7, 7, 6, 6, 6, 6]
    turn(kv, "publish", system + [0], root=ROOT_P)  # pages 0, 1 public
    hit_a, _ = turn(kv, "a", system + [1, 2, 3, 4, 5])  # pages 0, 1 + its own page 3 (0-2 taken, 2 freed)
    assert (hit_a.source, hit_a.block_ids, hit_a.public_blocks) == ("public", [0, 1], 2)
    a_page = kv.pool.block_of(hash_full_blocks(rebase(hit_a.block_hashes[-1], ROOT_A), [1, 2, 3, 4], 4)[0])
    assert a_page is not None and kv.pool.page_info(a_page).root == ROOT_A

    hit_a2 = kv.find_prefix(ROOT_A, system + [1, 2, 3, 4, 5])
    assert hit_a2.block_ids == [0, 1, a_page] and hit_a2.source == "public"
    hit_b = kv.find_prefix(ROOT_B, system + [1, 2, 3, 4, 5])
    assert hit_b.block_ids == [0, 1]  # tenant b shares the public pages, never a's
    # A plain public lookup cannot reach a's page either.
    assert kv.find_prefix(ROOT_P, system + [1, 2, 3, 4, 5]).block_ids == [0, 1]


def test_invalidating_a_tenant_spares_the_public_prefix():
    kv = manager()
    turn(kv, "publish", [7, 7, 7, 7, 0], root=ROOT_P)
    turn(kv, "a", [7, 7, 7, 7, 1, 1, 1, 1, 2])
    assert kv.invalidate_namespace(ROOT_A) == 1
    assert kv.find_prefix(ROOT_B, [7, 7, 7, 7, 1]).num_tokens == 4


# --- tags and invalidation --------------------------------------------------------------------------------------

def test_invalidating_a_tag_drops_every_page_derived_from_it():
    kv = manager(num_blocks=12)
    doc = [5, 5, 5, 5, 6, 6, 6, 6]
    turn(kv, "first", doc + [0], tag="doc:v3")  # tags pages 0, 1
    turn(kv, "q1", doc + [1, 1, 1, 1, 0])  # untagged request: its page after the document
    turn(kv, "q2", doc + [2, 2, 2, 2, 0])
    turn(kv, "unrelated", [4, 4, 4, 4, 0])
    assert kv.pool.num_cached_blocks == 5
    assert kv.invalidate_tag("doc:v3") == 4  # the document's pages and both questions' pages
    assert kv.find_prefix(ROOT_A, doc + [1, 1, 1, 1, 0]).num_tokens == 0
    assert kv.find_prefix(ROOT_A, [4, 4, 4, 4, 0]).num_tokens == 4


def test_invalidating_a_prefix_spares_pages_other_prefixes_share():
    kv = manager(num_blocks=12)
    system = [3, 3, 3, 3]
    turn(kv, "doc1", system + [5, 5, 5, 5, 6, 6, 6, 6, 0])
    turn(kv, "doc2", system + [8, 8, 8, 8, 0])
    assert kv.invalidate_prefix(ROOT_A, system + [5, 5, 5, 5, 6, 6, 6, 6]) == 2
    assert kv.find_prefix(ROOT_A, system + [5, 5, 5, 5, 6, 6, 6, 6, 0]).num_tokens == 4  # the shared system page
    assert kv.find_prefix(ROOT_A, system + [8, 8, 8, 8, 0]).num_tokens == 8


def test_pages_in_use_are_unindexed_at_once_and_freed_uncached_when_released():
    kv = manager()
    kv.allocate_slots("running", 9)
    kv.commit("running", ROOT_A, list(range(9)), 9)
    assert kv.invalidate_namespace(ROOT_A) == 2
    assert kv.find_prefix(ROOT_A, list(range(9))).num_tokens == 0  # no new request finds them
    assert kv.pool.ref_count(0) == 1  # the running request keeps reading them
    kv.free("running")
    assert kv.pool.num_cached_blocks == 0 and kv.num_free_blocks == 8


def test_a_session_after_its_pages_were_invalidated_misses():
    kv = manager()
    turn(kv, "t1", [1, 2, 3, 4, 5, 6], session="s", tag="doc")
    kv.invalidate_tag("doc")
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7], "s").num_tokens == 0


# --- hit-rate expiry --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_prefix_whose_hit_rate_falls_below_the_floor_expires(policy):
    clock = FakeClock(0.0)
    kv = manager(eviction_policy=policy, clock=clock, prefix_min_hits_per_hour=2)
    turn(kv, "hot", [1, 1, 1, 1, 0])
    turn(kv, "cold", [2, 2, 2, 2, 0])
    for i in range(3):
        clock.now = 600 * (i + 1)
        turn(kv, f"hit{i}", [1, 1, 1, 1, 0])
    clock.now = 3599
    assert kv.expire() == 0  # an hour's grace
    clock.now = 3600
    assert kv.expire() == 1  # cold: 0 hits in an hour; hot: 3
    assert kv.find_prefix(ROOT_A, [2, 2, 2, 2, 0]).num_tokens == 0
    assert kv.find_prefix(ROOT_A, [1, 1, 1, 1, 0]).num_tokens == 4
    clock.now = 7200  # hot: 3 hits in 2 hours, under 2 an hour now
    kv.expire()
    assert kv.find_prefix(ROOT_A, [1, 1, 1, 1, 0]).num_tokens == 0
