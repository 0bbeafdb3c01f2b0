"""Compaction on the cache manager with a tiny device pool: exact page ids, every reference renamed,
the KV bytes moved with their pages, hits that still hit, and the random workloads of
tests/test_eviction.py with compactions between their operations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import rule
from test_eviction import ROOT_A, EvictionMachine, computed, take_all

from kvtierd.cache.compaction import CompactionPlan, plan_compaction
from kvtierd.cache.eviction import EVICTION_POLICIES
from kvtierd.cache.fragmentation import PageUse, measure
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry

BS = 4
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)


# --- the definitions, on the picture of cache/fragmentation.py -----------------------------------------------

def picture() -> PageUse:
    """page 0 1 2 3 4 5 6 7 8 9 / holds A A . B . . A B . ."""
    return PageUse(10, live={0, 1, 3, 6, 7}, fixed=set(), sequences=[[0, 1, 6], [3, 7]], index_links=[])


def test_fragmentation_of_the_picture():
    f = measure(picture())
    assert (f.free_pages, f.free_runs, f.longest_free_run) == (5, 3, 2)
    assert f.free_space == pytest.approx(0.6)
    assert (f.chained_pages, f.scattered_pages) == (3, 2) and f.sequence == pytest.approx(2 / 3)


def test_the_plan_packs_each_sequence_in_order_and_swaps_the_free_pages_into_the_holes():
    plan = plan_compaction(picture())
    assert [plan.new_id[b] for b in (0, 1, 6, 3, 7)] == [0, 1, 2, 3, 4]  # A A A B B
    assert sorted(plan.new_id) == list(range(10))  # a permutation: free pages 2 and 4 went to 6 and 7
    assert (plan.new_id[2], plan.new_id[4]) == (6, 7)
    assert plan.copies == [(6, 2), (7, 4)] and plan.free == [5, 6, 7, 8, 9]
    after = PageUse(10, {0, 1, 2, 3, 4}, set(), [[0, 1, 2], [3, 4]], [])
    assert measure(after).free_space == 0 and measure(after).sequence == 0
    assert plan_compaction(after).copies == []  # a compacted pool plans no moves


def test_the_index_is_laid_out_depth_first_and_a_branch_follows_its_parents_subtree():
    # Chain 9 -> 5 -> 2 branches at 5 into 2 and 7 -> 8; page 4 is a chain of one.
    use = PageUse(10, {9, 5, 2, 7, 8, 4}, set(), [], [(9, 5), (5, 2), (5, 7), (7, 8)])
    plan = plan_compaction(use)
    assert [plan.new_id[b] for b in (9, 5, 2, 7, 8, 4)] == [0, 1, 2, 3, 4, 5]
    assert measure(use).scattered_pages == 2  # 9 and 5; 7 -> 8 is in order
    assert _after(use, plan).sequence == 0  # 5 is followed by 2, one of its branches: in order


def test_a_sequence_goes_before_the_other_branches_of_its_chain():
    # Page 0 branches into 3 (cached) and 5 (a running sequence's next page).
    use = PageUse(8, {0, 3, 5}, set(), [[0, 5]], [(0, 3)])
    new_id = plan_compaction(use).new_id
    assert [new_id[b] for b in (0, 5, 3)] == [0, 1, 2]


def _after(use: PageUse, plan: CompactionPlan):
    n = plan.new_id
    return measure(PageUse(use.num_blocks, {n[b] for b in use.live}, {n[b] for b in use.fixed},
                           [[n[b] for b in s] for s in use.sequences], [(n[a], n[b]) for a, b in use.index_links]))


# --- the cache manager and the device pool ------------------------------------------------------------------

def kv_at(token: int, pos: int, layer: int) -> torch.Tensor:
    """The K a step writes for `token` at `pos` in `layer` (V is its negation): each slot tells what it holds."""
    return torch.tensor([[token + 1000.0 * layer, float(pos)]])


def compute(kv: KVCacheManager, dev: DeviceKVPool, seq: str, tokens: list[int], start: int, root=ROOT_A,
            tag: str | None = None) -> None:
    """Computes tokens[start:] of `seq` as a step would: slots allocated, copies made, K/V written, pages indexed."""
    alloc = kv.allocate_slots(seq, len(tokens) - start)
    dev.copy_blocks(alloc.copies)
    for pos, slot in zip(range(start, len(tokens)), alloc.slots):
        for layer, (k, v) in enumerate(dev.kv_caches):
            k[slot // BS, slot % BS] = kv_at(tokens[pos], pos, layer)
            v[slot // BS, slot % BS] = -kv_at(tokens[pos], pos, layer)
    kv.commit(seq, root, tokens, len(tokens), tag)


def start(kv: KVCacheManager, dev: DeviceKVPool, seq: str, tokens: list[int], session: str | None = None,
          tag: str | None = None) -> int:
    """Admits a request with its cached prefix and computes the rest; returns the tokens it hit."""
    hit = kv.adopt_prefix(seq, kv.find_prefix(ROOT_A, tokens, session), tag)
    compute(kv, dev, seq, tokens, hit.num_tokens, tag=tag)
    return hit.num_tokens


def finish(kv: KVCacheManager, seq: str, tokens: list[int], session: str | None = None) -> None:
    if session is not None:
        kv.keep_session(seq, (ROOT_A, session), tokens, len(tokens))
    kv.free(seq)


def holds(dev: DeviceKVPool, pages: list[int], tokens: list[int]) -> bool:
    """Whether `pages` hold the K/V of `tokens` at their positions, in every layer."""
    return all(torch.equal(k[pages[p // BS], p % BS], kv_at(t, p, layer)) and
               torch.equal(v[pages[p // BS], p % BS], -kv_at(t, p, layer))
               for layer, (k, v) in enumerate(dev.kv_caches) for p, t in enumerate(tokens))


def compact(kv: KVCacheManager, dev: DeviceKVPool) -> CompactionPlan:
    """What LLMEngine.compact does: plan, copy the live pages that move, rename."""
    plan = kv.plan_compaction()
    dev.copy_blocks(plan.copies)
    kv.apply_compaction(plan)
    return plan


DOC = list(range(100, 110))  # two full pages and half of a third
A = DOC + [1, 2, 3, 4, 5, 6]  # four full pages
B = DOC + [7, 8, 9, 10, 11, 12, 13]
S = list(range(50, 63))  # a session's turn: three full pages and one token
C, D = list(range(200, 216)), list(range(300, 316))
E = A + [70, 71, 72]


def fragmented(num_blocks: int = 32) -> tuple[KVCacheManager, DeviceKVPool, dict[str, list[int]]]:
    """A pool with cached chains, a hole left by an invalidation, a session pool, a pin, two running
    sequences whose pages interleave and one that shares a cached prefix. Returns the running ones' tokens."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, pin_budget_pages=8)
    dev = DeviceKVPool(GEOMETRY, num_blocks, torch.device("cpu"))
    start(kv, dev, "a", A)
    finish(kv, "a", A)
    start(kv, dev, "b", B, tag="doc:b")
    finish(kv, "b", B)
    start(kv, dev, "s", S, session="s")
    finish(kv, "s", S, session="s")
    for i in range(0, 16, BS):  # c and d grow a page each in turn
        for seq, tokens in (("c", C), ("d", D)):
            compute(kv, dev, seq, tokens[: i + BS], i)
    kv.invalidate_prefix(ROOT_A, B)  # B's own pages go; the document's stay (A shares them)
    assert kv.pin_prefix("pin-a", ROOT_A, A) is not None
    assert start(kv, dev, "e", E) == 16
    return kv, dev, {"c": list(C), "d": list(D), "e": list(E)}


def test_compaction_renames_every_reference_and_moves_the_kv_with_it():
    kv, dev, running = fragmented()
    pool = kv.pool
    before = kv.fragmentation()
    assert before.free_runs > 1 and before.sequence > 0.3
    tables = {seq: kv.block_ids(seq) for seq in running}
    session = list(kv.sessions.get((ROOT_A, "s")).block_ids)
    pinned = list(kv.pins.get("pin-a").block_ids)
    indexed = dict(pool.cached_blocks())
    refs = {b: (pool.ref_count(b), pool.index.hits.get(b), pool.index.tags.get(b), pool.is_pinned(b)) for b in range(32)}
    live = kv.page_use().live
    snapshot = [(k.clone(), v.clone()) for k, v in dev.kv_caches]
    num_free = kv.num_free_blocks

    plan = compact(kv, dev)
    new = plan.new_id
    assert plan.copies and sorted(new) == list(range(32))
    for seq, tokens in running.items():
        assert kv.block_ids(seq) == [new[b] for b in tables[seq]]
        assert holds(dev, kv.block_ids(seq), tokens)
    assert kv.sessions.get((ROOT_A, "s")).block_ids == [new[b] for b in session]
    assert kv.pins.get("pin-a").block_ids == [new[b] for b in pinned]
    assert dict(pool.cached_blocks()) == {new[b]: page for b, page in indexed.items()}
    assert all(pool.block_of(page.block_hash) == new[b] for b, page in indexed.items())
    assert all(refs[b] == (pool.ref_count(new[b]), pool.index.hits.get(new[b]), pool.index.tags.get(new[b]),
                           pool.is_pinned(new[b])) for b in range(32))
    for layer, (k, v) in enumerate(dev.kv_caches):
        for b in live:
            assert torch.equal(k[new[b]], snapshot[layer][0][b]) and torch.equal(v[new[b]], snapshot[layer][1][b])
    assert kv.num_free_blocks == num_free  # nothing leaked, nothing freed

    after = kv.fragmentation()
    assert after.free_runs == 1 and after.free_space == after.sequence == 0
    assert plan.free == list(range(len(live), 32)) == [b for b in range(32) if b not in kv.page_use().live]
    assert kv.plan_compaction().copies == []  # already compact


def test_hits_still_hit_after_compaction_and_serve_the_same_kv():
    kv, dev, running = fragmented()
    prompts = [(A + [0], None), (B + [0], None), (E + [0], None), (S + [0], "s"), (S[:6] + [9], "s"), (C + [0], None)]
    hits = [kv.find_prefix(ROOT_A, p, s) for p, s in prompts]
    assert [h.source for h in hits] == ["prefix", "prefix", "prefix", "session", "session", "prefix"]
    compact(kv, dev)
    for (prompt, session), hit in zip(prompts, hits):
        again = kv.find_prefix(ROOT_A, prompt, session)
        assert (again.num_tokens, again.source) == (hit.num_tokens, hit.source)
        assert holds(dev, again.block_ids, prompt[: again.num_tokens])
    # The session's next turn takes its pool, to the token, then computes on.
    turn = S + [40, 41, 42, 43, 44]
    assert start(kv, dev, "s2", turn, session="s") == len(S)
    assert holds(dev, kv.block_ids("s2"), turn)


def test_after_compaction_new_pages_come_from_the_bottom_of_the_free_run_and_nothing_leaks():
    kv, dev, running = fragmented()
    compact(kv, dev)
    free = [b for b in range(32) if b not in kv.page_use().live]
    start(kv, dev, "f", list(range(400, 410)))
    assert kv.block_ids("f") == free[:3]  # one contiguous run
    for seq, tokens in {**running, "f": list(range(400, 410))}.items():
        finish(kv, seq, tokens)
    kv.unpin("pin-a")
    assert kv.num_free_blocks == 32


def test_a_page_held_outside_every_page_table_keeps_its_id():
    kv, dev, running = fragmented()
    held = kv.pool.allocate(1)  # e.g. a load in flight
    plan = compact(kv, dev)
    assert plan.new_id[held[0]] == held[0]
    assert kv.fragmentation().free_runs <= 2  # the held page may split the free run, nothing else does
    kv.pool.release(held)


def test_compaction_between_steps_of_a_pool_that_evicts_keeps_the_pages_its_runs_need():
    kv, dev, running = fragmented(num_blocks=21)
    compact(kv, dev)
    for seq, tokens in running.items():  # two more pages each: the last ones evict cached pages
        computed_before = len(tokens)
        tokens += list(range(900, 900 + 2 * BS))
        compute(kv, dev, seq, tokens, computed_before)
        compact(kv, dev)
        assert all(holds(dev, kv.block_ids(s), t) for s, t in running.items())
    assert kv.pool.evictions.capacity > 0


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_the_eviction_order_is_the_same_after_compaction(policy):
    def build() -> KVCacheManager:
        kv = KVCacheManager(num_blocks=16, block_size=2, eviction_policy=policy)
        for seq, tokens in (("a", [1, 2, 3, 4, 5, 6]), ("b", [1, 2, 7, 8]), ("c", [9, 9, 9, 9]), ("x", [5, 5])):
            computed(kv, seq, tokens)
        kv.free("b")
        kv.free("a")
        hit = kv.find_prefix(ROOT_A, [1, 2, 3, 4, 0])
        kv.adopt_prefix("r", hit)  # a hit: lfu and cost order by hits
        kv.free("r")
        kv.free("c")
        return kv

    def evicted(kv: KVCacheManager) -> list[tuple[int, ...]]:
        cached = {b: page.tokens for b, page in kv.pool.cached_blocks()}
        return [cached[b] for b in take_all(kv) if b in cached]

    plain, compacted = build(), build()
    plan = compacted.plan_compaction()
    assert plan.copies
    compacted.apply_compaction(plan)
    assert evicted(compacted) == evicted(plain)


# --- random workloads: every check of tests/test_eviction.py, with compactions between operations ------------

class CompactingMachine(EvictionMachine):
    """The eviction machine's device is `cells` (slot -> token); a compaction moves them as the plan says."""

    @rule()
    def compact(self):
        kv = self.kv
        sessions = [(key, list(chain.token_ids) + [-1]) for key, chain in kv.sessions]
        hits = [(key, tokens, kv.find_prefix(key[0], tokens, key[1])) for key, tokens in sessions]
        plan = kv.plan_compaction()
        bs, cells = kv.block_size, dict(self.cells)  # every source is read before any destination is written
        for src, dst in plan.copies:
            for off in range(bs):
                if src * bs + off in cells:
                    self.cells[dst * bs + off] = cells[src * bs + off]
                else:
                    self.cells.pop(dst * bs + off, None)
        kv.apply_compaction(plan)
        for key, tokens, hit in hits:
            again = kv.find_prefix(key[0], tokens, key[1])
            assert (again.num_tokens, again.source) == (hit.num_tokens, hit.source)
        assert kv.fragmentation().free_space == 0
        assert kv.plan_compaction().copies == []


COMPACTING_SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None)


class CompactingLRU(CompactingMachine):
    policy = "lru"


class CompactingLFU(CompactingMachine):
    policy = "lfu"


class CompactingCost(CompactingMachine):
    policy = "cost"


TestCompactingLRU = CompactingLRU.TestCase
TestCompactingLRU.settings = COMPACTING_SETTINGS
TestCompactingLFU = CompactingLFU.TestCase
TestCompactingLFU.settings = COMPACTING_SETTINGS
TestCompactingCost = CompactingCost.TestCase
TestCompactingCost.settings = COMPACTING_SETTINGS
