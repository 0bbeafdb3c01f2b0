"""Page accounting and the prefix index: exact page ids on a tiny pool."""

from __future__ import annotations

import pytest

from kvtierd.cache.block_hash import HASH_FUNCTIONS, hash_full_blocks, namespace_root
from kvtierd.cache.kv_cache_manager import KVCacheManager


def test_pages_fill_in_order_and_return_to_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = kv.allocate_slots("a", 6)  # pages 0 and 1, the second half full
    assert kv.block_ids("a") == [0, 1]
    assert a.slots == [0, 1, 2, 3, 4, 5] and a.copies == []
    assert kv.allocate_slots("a", 2).slots == [6, 7]  # fills page 1, no new page
    assert kv.allocate_slots("b", 5).slots == [8, 9, 10, 11, 12]  # pages 2 and 3
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("a", 1) is None  # out of pages: back-pressure, not an error
    assert kv.block_ids("a") == [0, 1]  # ... and nothing changed
    kv.free("a")
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots("c", 1).slots == [4]  # a freed chain is reused tail first


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate_slots("parent", 6)  # pages 0 (full), 1 (2 of 4)
    kv.fork("parent", "child")
    assert kv.block_ids("child") == [0, 1]
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 2

    write = kv.allocate_slots("child", 1)
    assert write.copies == [(1, 2)]  # the child writes into its own copy of page 1
    assert kv.block_ids("child") == [0, 2] and write.slots == [2 * 4 + 2]
    assert kv.pool.ref_count(1) == 1 and kv.pool.ref_count(0) == 2

    write = kv.allocate_slots("parent", 1)  # page 1 is the parent's alone now: no copy
    assert write.copies == [] and write.slots == [1 * 4 + 2]
    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == 6


def test_a_full_shared_page_is_never_copied():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("p", 4)
    kv.fork("p", "c")
    w = kv.allocate_slots("c", 1)
    assert w.copies == [] and kv.block_ids("c") == [0, 1]


# The random-workload invariants (no leak, ref counts, each sequence reads back its own
# tokens) run as state machines under every eviction policy in tests/test_eviction.py.


ROOT_A = namespace_root("model-1", "tenant-a")


def computed(kv: KVCacheManager, seq: str, tokens: list[int], root=ROOT_A) -> None:
    """Allocates and commits `tokens` for a new sequence, as a step would."""
    kv.allocate_slots(seq, len(tokens))
    kv.commit(seq, root, tokens, len(tokens))


def test_full_pages_are_found_again_by_prefix_and_shared():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, "a", list(range(10)))  # pages 0, 1 full; page 2 partial (not indexed)
    hit = kv.find_prefix(ROOT_A, list(range(9)) + [99, 98])
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    kv.adopt_prefix("b", hit)
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 2
    assert kv.allocate_slots("b", 3).slots == [12, 13, 14]  # its own page 3 for tokens 8..10


def test_a_hit_always_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, "a", list(range(8)))
    assert kv.find_prefix(ROOT_A, list(range(9))).num_tokens == 8
    assert kv.find_prefix(ROOT_A, list(range(7))).num_tokens == 4  # a page holding tokens past the prompt: no


def test_a_prompt_cached_to_its_last_token_computes_that_token_alone_in_a_copy_of_its_last_page():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, "a", list(range(8)))
    kv.free("a")
    hit = kv.find_prefix(ROOT_A, list(range(8)))
    assert hit.block_ids == [0, 1] and hit.num_tokens == 7  # not 4: its last page is not recomputed whole
    assert len(hit.block_hashes) == 1  # page 1 counts as the request's own once its last token is written
    kv.adopt_prefix("b", hit)
    write = kv.allocate_slots("b", 1)
    assert write.copies == [(1, 2)] and write.slots == [2 * 4 + 3]  # the indexed page stays as it was
    kv.commit("b", ROOT_A, list(range(8)), 8)
    assert kv.find_prefix(ROOT_A, list(range(9))).block_ids == [0, 1]  # the first page with the hash keeps it
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2


def test_released_pages_stay_cached_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    computed(kv, "a", [1, 2, 3, 4, 5, 6])  # pages 0, 1, 2, all full and indexed
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 3
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7]).block_ids == [0, 1, 2]
    kv.allocate_slots("b", 4)  # takes never-used page 3, then the chain's tail, page 2
    assert kv.block_ids("b") == [3, 2]
    assert kv.find_prefix(ROOT_A, [1, 2, 3, 4, 5, 6, 7]).block_ids == [0, 1]


def test_namespaces_do_not_share_pages():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, "a", list(range(9)))
    assert kv.find_prefix(namespace_root("model-1", "tenant-b"), list(range(9))).num_tokens == 0
    assert kv.find_prefix(namespace_root("model-2", "tenant-a"), list(range(9))).num_tokens == 0
    assert kv.find_prefix(ROOT_A, list(range(9))).num_tokens == 8


def test_a_page_whose_tokens_do_not_match_its_hash_is_never_used():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    kv.allocate_slots("a", 9)
    # Plant page 1 under the hash of the right prefix but with other tokens.
    hashes = hash_full_blocks(ROOT_A, tokens, 4)
    kv.pool.cache(kv.block_ids("a")[0], hashes[0], tokens[0:4], ROOT_A)
    kv.pool.cache(kv.block_ids("a")[1], hashes[1], [7, 7, 7, 7], ROOT_A)
    hit = kv.find_prefix(ROOT_A, tokens)
    assert hit.block_ids == [kv.block_ids("a")[0]] and kv.pool.index.num_token_mismatches == 1


@pytest.mark.parametrize("algorithm", HASH_FUNCTIONS)
def test_every_hash_function_indexes_and_finds_pages(algorithm):
    kv = KVCacheManager(num_blocks=8, block_size=4, hash_algorithm=algorithm)
    root = namespace_root("model-1", "tenant-a", algorithm)
    computed(kv, "a", list(range(10)), root)
    assert kv.find_prefix(root, list(range(10))).block_ids == kv.block_ids("a")[:2]
    assert len({namespace_root("model-1", "tenant-a", a) for a in HASH_FUNCTIONS}) == len(HASH_FUNCTIONS)
