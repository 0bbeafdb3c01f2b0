"""The tier manager on a tiny geometry: the chunk key scheme, saves and loads byte-exact, the disk tier
across a reopen, corrupt values, invalidation; and the block pool's chunk-wise capacity evictions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_paced_loads import wait_until

from kvtierd.cache.block_hash import hash_full_blocks
from kvtierd.cache.block_pool import BlockPool
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.chunk import ChunkCopy, spans_of
from kvtierd.tiers.config import TierConfig
from kvtierd.tiers.page_copy import page_runs
from kvtierd.tiers.store_name import disk_store_name
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.tier_pins import TierPinError

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float16)
ROOT = b"r" * 16
N = 2  # pages per chunk


def make_device(num_blocks: int = 16) -> DeviceKVPool:
    device = DeviceKVPool(GEOMETRY, num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for k, v in device.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return device


def make_tiers(device: DeviceKVPool, disk: Path | None = None, host: bool = True, **kw) -> TierManager:
    return TierManager(TierConfig(host_bytes=(1 << 20) if host else 0, disk_bytes=64 << 20, disk_path=disk,
                                  chunk_pages=N, **kw), device)


def chain(num_pages: int, seed: int = 0) -> tuple[list[bytes], list[int]]:
    tokens = [seed * 1000 + i for i in range(num_pages * GEOMETRY.block_size)]
    return hash_full_blocks(ROOT, tokens, GEOMETRY.block_size), tokens


def copies(hashes: list[bytes], tokens: list[int], block_ids: list[int], hits: int = 0) -> list[ChunkCopy]:
    spans = spans_of(ROOT, hashes, tokens, GEOMETRY.block_size, N)
    return [ChunkCopy(s, tuple(block_ids[s.first_page : s.first_page + s.num_pages]), hits) for s in spans]


def pages(device: DeviceKVPool, block_ids: list[int]) -> list[torch.Tensor]:
    return [t[block_ids].clone() for k, v in device.kv_caches for t in (k, v)]


def load_all(tiers: TierManager, hashes: list[bytes], tokens: list[int], start: int, first_free: int) -> list[int]:
    """Loads what the lookup finds after `start` device pages into pages from `first_free` on; returns them."""
    loaded, depth = [], start
    for found in tiers.lookup(ROOT, hashes, tokens, start):
        skip = depth - found.span.first_page
        fresh = list(range(first_free + len(loaded), first_free + len(loaded) + found.span.num_pages - skip))
        assert tiers.load(found, skip, fresh)
        loaded += fresh
        depth += len(fresh)
    return loaded


def layout(found) -> list[tuple[str, int, int]]:
    return [(f.tier, f.span.first_page, f.span.num_pages) for f in found]


def test_chunks_are_aligned_and_keyed_by_their_last_page():
    hashes, tokens = chain(5)
    spans = spans_of(ROOT, hashes, tokens, GEOMETRY.block_size, N)
    assert [(s.first_page, s.num_pages) for s in spans] == [(0, 2), (2, 2), (4, 1)]
    assert [s.last_hash for s in spans] == [hashes[1], hashes[3], hashes[4]]
    assert spans[2].token_ids == tuple(tokens[16:20])


def test_a_chain_saved_to_host_comes_back_byte_exact():
    device = make_device()
    tiers = make_tiers(device)
    hashes, tokens = chain(5)
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3, 4]))
    loaded = load_all(tiers, hashes, tokens, 0, first_free=8)
    assert loaded == [8, 9, 10, 11, 12]
    for a, b in zip(pages(device, [0, 1, 2, 3, 4]), pages(device, loaded)):
        assert torch.equal(a, b)
    host = tiers.stats()[0]
    assert (host.entries, host.writes, host.hits, host.hit_tokens) == (3, 3, 3, 20)


def test_the_lookup_finds_the_longest_stored_prefix():
    device = make_device()
    tiers = make_tiers(device)
    hashes, tokens = chain(5)
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3, 4]))
    assert layout(tiers.lookup(ROOT, hashes, tokens, 0)) == [("host", 0, 2), ("host", 2, 2), ("host", 4, 1)]
    # A shorter prompt cannot reach the partial chunk (its key is page 4's hash).
    assert layout(tiers.lookup(ROOT, hashes[:4], tokens[:16], 0)) == [("host", 0, 2), ("host", 2, 2)]
    # A longer prompt: no whole chunk at pages 4..5, so the partial one is tried.
    longer, longer_tokens = chain(7)
    assert layout(tiers.lookup(ROOT, longer, longer_tokens, 0)) == [("host", 0, 2), ("host", 2, 2), ("host", 4, 1)]
    # A device hit of 3 pages starts the lookup at its chunk (loading skips page 2).
    assert layout(tiers.lookup(ROOT, hashes, tokens, 3)) == [("host", 2, 2), ("host", 4, 1)]
    # Another chain (other tokens) finds nothing.
    other, other_tokens = chain(5, seed=1)
    assert tiers.lookup(ROOT, other, other_tokens, 0) == []


def test_a_lookup_asks_a_tier_once_unless_its_run_stops_midway(tmp_path):
    """A slow tier (a Redis with a delay) costs its delay per call: a tier is asked once, for every whole chunk
    and the partial last chunks a chain ends with when none or all of its whole chunks are found (a new prompt's
    lookup waited 15 round trips, one a length, then two); a run that stops midway asks once more, for the
    partial chunks past it."""
    device = make_device()
    tiers = TierManager(TierConfig(host_bytes=0, disk_bytes=64 << 20, disk_path=tmp_path, chunk_pages=4), device)
    hashes, tokens = chain(6)
    spans = spans_of(ROOT, hashes, tokens, GEOMETRY.block_size, 4)
    tiers.write_turn([ChunkCopy(s, tuple(range(s.first_page, s.first_page + s.num_pages))) for s in spans], True)
    tiers.wait()
    calls = []
    disk = tiers.disk
    for name in ("contains_prefix", "contains_each"):
        real = getattr(disk, name)
        setattr(disk, name, lambda keys, real=real, name=name: calls.append(name) or real(keys))
    assert layout(tiers.lookup(ROOT, hashes, tokens, 0)) == [("disk", 0, 4), ("disk", 4, 2)]
    assert calls == ["contains_each"]  # found whole, its partial tail among the first call's questions
    calls.clear()
    longer, longer_tokens = chain(11)
    assert layout(tiers.lookup(ROOT, longer, longer_tokens, 0)) == [("disk", 0, 4), ("disk", 4, 2)]
    assert calls == ["contains_each", "contains_each"]  # its run stops at page 4: the partial past it, asked then
    calls.clear()
    other, other_tokens = chain(11, seed=1)
    assert tiers.lookup(ROOT, other, other_tokens, 0) == [] and calls == ["contains_each"]
    tiers.close()


def test_a_partial_device_hit_loads_only_the_missing_pages():
    device = make_device()
    tiers = make_tiers(device)
    hashes, tokens = chain(4)
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3]))
    loaded = load_all(tiers, hashes, tokens, 3, first_free=8)
    assert loaded == [8]
    for a, b in zip(pages(device, [3]), pages(device, [8])):
        assert torch.equal(a, b)


def test_reconcile_deletes_uncataloged_turn_chunks_and_names_missing_keys(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path, host=False, disk_admission="all")
    hashes, tokens = chain(4)
    turn_keys = tiers.write_turn(copies(hashes, tokens, [0, 1, 2, 3]), session=True)
    assert turn_keys == tuple(tiers.epoch.key(hashes[i]) for i in (1, 3))  # one per chunk, for the catalog
    other_hashes, other_tokens = chain(2, seed=1)
    tiers.demote(copies(other_hashes, other_tokens, [4, 5]))  # evicted cache: not the catalog's business
    tiers.wait()
    gone = b"\x01" * 16  # a row naming a chunk the disk does not hold
    settled = tiers.reconcile({turn_keys[1], gone})
    assert settled.orphan_values == 1 and settled.missing_keys == (gone,)
    assert tiers.disk.contains_prefix([turn_keys[0]]) == 0  # no row names it: deleted
    assert tiers.disk.contains_prefix([turn_keys[1], tiers.epoch.key(other_hashes[1])]) == 2
    assert tiers.write_turn(copies(hashes, tokens, [0, 1, 2, 3]), session=True) == turn_keys  # stored or queued
    tiers.close()


def test_warm_copies_disk_chunks_to_the_host_tier_checked_against_their_keys(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path)
    old_hashes, old_tokens = chain(2, seed=2)
    (old_key,) = tiers.write_turn(copies(old_hashes, old_tokens, [6, 7]), session=True)
    tiers.wait()
    tiers.invalidate_all()  # a new epoch: the old value is still on disk, under a key nothing asks for
    hashes, tokens = chain(4)
    keys = tiers.write_turn(copies(hashes, tokens, [0, 1, 2, 3]), session=True)
    tiers.wait()
    assert tiers.host.contains_prefix([keys[0]]) == 0  # a turn writes through to disk only
    assert tiers.warm([old_key, *keys]).result(timeout=30) == 2
    assert tiers.host.contains_prefix(list(keys)) == 2 and tiers.host.contains_prefix([old_key]) == 0
    loaded = load_all(tiers, hashes, tokens, 0, first_free=8)
    for a, b in zip(pages(device, [0, 1, 2, 3]), pages(device, loaded)):
        assert torch.equal(a, b)
    assert set(tiers.planner.rates()[0]) == {"host"}  # served from memory...
    assert tiers.counts["disk"].hits == 2 and tiers.counts["disk"].prefetched == 2  # ...counted for the disk
    assert tiers.warm(keys).result(timeout=30) == 0  # already there
    tiers.close()


def test_the_disk_tier_outlives_the_process(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path, host=False)
    hashes, tokens = chain(5)
    tiers.write_turn(copies(hashes, tokens, [0, 1, 2, 3, 4]), session=True)
    tiers.close()  # commits what was queued
    again = make_tiers(device, tmp_path, host=False)
    assert [f.tier for f in again.lookup(ROOT, hashes, tokens, 0)] == ["disk"] * 3
    loaded = load_all(again, hashes, tokens, 0, first_free=8)
    for a, b in zip(pages(device, [0, 1, 2, 3, 4]), pages(device, loaded)):
        assert torch.equal(a, b)
    disk = again.stats()[1]
    assert disk.enabled and disk.healthy and disk.entries == 3 and disk.hits == 3
    again.close()


def test_disk_admission_takes_reused_chunks_unless_told_all(tmp_path):
    device = make_device()
    (tmp_path / "a").mkdir()
    tiers = make_tiers(device, tmp_path / "a", host=False)
    hashes, tokens = chain(4)
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3])[:1])  # never hit: host only, and there is no host
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3], hits=1)[1:])
    tiers.wait()
    assert tiers.stats()[1].entries == 1
    (tmp_path / "b").mkdir()
    everything = make_tiers(device, tmp_path / "b", host=False, disk_admission="all")
    everything.demote(copies(hashes, tokens, [0, 1, 2, 3]))
    everything.wait()
    assert everything.stats()[1].entries == 2
    tiers.close()
    everything.close()


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_a_corrupt_disk_value_is_a_miss_and_quarantined(tmp_path, codec):
    device = make_device()
    tiers = make_tiers(device, tmp_path, host=False, disk_codec=codec)
    hashes, tokens = chain(2)
    tiers.write_turn(copies(hashes, tokens, [0, 1]), session=True)
    tiers.wait()
    key = tiers.epoch.key(hashes[1])
    frame = bytearray(tiers.disk.get_many([key])[0])
    frame[-1] ^= 0xFF
    assert tiers.disk.put_many([(key, bytes(frame))])
    (found,) = tiers.lookup(ROOT, hashes, tokens, 0)
    before = pages(device, [8, 9])
    assert not tiers.load(found, 0, [8, 9])
    tiers.wait()
    if codec != "raw":  # decoded and checked before any copy; a raw payload is hashed as it is copied (one
        # pass), so the failed load's own pages hold garbage, which nothing reads: they were never committed
        assert all(torch.equal(a, b) for a, b in zip(before, pages(device, [8, 9])))  # nothing written
    disk = tiers.stats()[1]
    assert disk.corrupt == 1 and disk.entries == 0
    assert tiers.lookup(ROOT, hashes, tokens, 0) == []
    tiers.close()


def test_invalidation_makes_everything_unreachable_across_a_reopen(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path)
    hashes, tokens = chain(4)
    tiers.demote(copies(hashes, tokens, [0, 1, 2, 3], hits=1))
    tiers.wait()
    assert len(tiers.lookup(ROOT, hashes, tokens, 0)) == 2
    tiers.invalidate_all()
    assert tiers.lookup(ROOT, hashes, tokens, 0) == []
    tiers.close()
    assert make_tiers(device, tmp_path).lookup(ROOT, hashes, tokens, 0) == []


def test_forget_drops_the_chunks_of_a_chain(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path)
    hashes, tokens = chain(3)
    tiers.demote(copies(hashes, tokens, [0, 1, 2], hits=1))
    tiers.wait()
    tiers.forget(hashes[2:])  # the chain's own pages from page 2: its partial chunk
    tiers.wait()
    assert [f.span.num_pages for f in tiers.lookup(ROOT, hashes, tokens, 0)] == [2]
    tiers.close()


def test_an_unavailable_disk_leaves_the_host_tier_working(tmp_path):
    device = make_device()
    tiers = make_tiers(device, tmp_path / "missing")
    host, disk = tiers.stats()
    assert host.enabled and host.healthy
    assert not disk.enabled and "missing" in disk.reason
    hashes, tokens = chain(2)
    tiers.write_turn(copies(hashes, tokens, [0, 1]), session=True)  # nowhere to write: a no-op
    tiers.demote(copies(hashes, tokens, [0, 1]))
    assert [f.tier for f in tiers.lookup(ROOT, hashes, tokens, 0)] == ["host"]


def test_a_host_budget_under_one_chunk_turns_the_host_tier_off():
    tiers = TierManager(TierConfig(host_bytes=100, disk_bytes=0, chunk_pages=N), make_device())
    host, disk = tiers.stats()
    assert not host.enabled and "holds no slot" in host.reason
    assert not disk.enabled and disk.reason == "off: disk_bytes is 0"


# -- the block pool's side: capacity evictions go chunk by chunk ---------------------------------------

def indexed_chain(pool: BlockPool, num_pages: int) -> list[int]:
    hashes, tokens = chain(num_pages)
    blocks = pool.allocate(num_pages)
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache(b, h, tokens[i * 4 : (i + 1) * 4], ROOT, depth=i, parent=hashes[i - 1] if i else None)
    pool.release(blocks)
    return blocks


def test_a_capacity_eviction_takes_and_logs_the_whole_chunk():
    pool = BlockPool(5)
    pool.chunk_pages = N
    blocks = indexed_chain(pool, 5)  # chunks: pages 0-1, 2-3, 4
    assert pool.allocate(1) == [blocks[4]]  # the tail goes first; its chunk is that page alone
    (first,) = pool.evicted
    assert (first.first_depth, first.block_ids) == (4, (blocks[4],))
    taken = pool.allocate(1)
    assert taken == [blocks[3]]
    second = pool.evicted[1]
    assert (second.first_depth, second.block_ids) == (2, (blocks[2], blocks[3]))
    assert second.token_ids == tuple(range(8, 16))
    # Page 2 went with its chunk: it is free and uncached, first in line.
    assert pool.page_info(blocks[2]) is None and pool.allocate(1) == [blocks[2]]
    assert pool.evictions.capacity == 3


def test_a_chunk_page_someone_holds_stays_indexed():
    pool = BlockPool(4)
    pool.chunk_pages = N
    blocks = indexed_chain(pool, 2)
    pool.touch([blocks[0]])  # another request holds the chunk's first page
    pool.allocate(2)  # the two never-used pages
    assert pool.allocate(1) == [blocks[1]]
    assert pool.evicted[0].block_ids == (blocks[0], blocks[1])  # saved whole: page 0's KV is intact
    assert pool.page_info(blocks[0]) is not None


def test_without_lower_tiers_nothing_is_logged():
    pool = BlockPool(2)
    indexed_chain(pool, 2)
    pool.allocate(2)
    assert pool.evicted == [] and pool.evictions.capacity == 2


@pytest.mark.parametrize("bad", [{"chunk_pages": 0}, {"disk_codec": "lz4"}, {"disk_admission": "some"},
                                 {"host_bytes": -1}])
def test_bad_tier_configs_are_refused(bad):
    with pytest.raises(ValueError):
        TierConfig(**bad)


def small_host_tiers(device: DeviceKVPool, slots: int, disk: Path | None = None) -> TierManager:
    slot = make_tiers(device).host.slot_bytes
    return TierManager(TierConfig(host_bytes=slots * slot, disk_bytes=64 << 20, disk_path=disk, chunk_pages=N), device)


def test_chunks_pinned_in_the_host_tier_outlive_its_lru_until_unpinned():
    device = make_device(32)
    tiers = small_host_tiers(device, slots=6)
    pinned_hashes, pinned_tokens = chain(4, seed=1)
    ours = copies(pinned_hashes, pinned_tokens, [0, 1, 2, 3])
    before = pages(device, [0, 1, 2, 3])
    assert tiers.pins.pin("host", "pin-a", ours, share=0.5)  # written to the host tier, then pinned
    assert tiers.pins.pinned_bytes("host") == 4 * GEOMETRY.bytes_per_block
    for seed in range(2, 8):  # 12 other chunks through 4 unpinned slots
        hashes, tokens = chain(4, seed)
        tiers.demote(copies(hashes, tokens, [4, 5, 6, 7]))
    assert layout(tiers.lookup(ROOT, pinned_hashes, pinned_tokens, 0)) == [("host", 0, 2), ("host", 2, 2)]
    assert load_all(tiers, pinned_hashes, pinned_tokens, 0, 20) == [20, 21, 22, 23]
    assert all(torch.equal(a, b) for a, b in zip(pages(device, [20, 21, 22, 23]), before))
    assert tiers.pins.unpin("pin-a") is not None and tiers.pins.pinned_bytes("host") == 0
    for seed in range(8, 11):
        hashes, tokens = chain(4, seed)
        tiers.demote(copies(hashes, tokens, [4, 5, 6, 7]))
    assert tiers.lookup(ROOT, pinned_hashes, pinned_tokens, 0) == []


def test_a_pin_over_its_tiers_budget_or_without_its_tier_is_refused():
    device = make_device(32)
    tiers = small_host_tiers(device, slots=6)
    hashes, tokens = chain(8, seed=1)
    with pytest.raises(TierPinError, match="over its pin budget"):
        tiers.pins.pin("host", "big", copies(hashes, tokens, list(range(8))), share=0.25)
    assert len(tiers.pins) == 0 and tiers.lookup(ROOT, hashes, tokens, 0) == []  # nothing written for a refused pin
    with pytest.raises(TierPinError, match="no disk tier"):
        tiers.pins.pin("disk", "d", copies(hashes, tokens, list(range(8))), share=0.5)


def test_a_disk_pin_writes_what_is_missing_at_once_and_is_found_again_after_a_reopen(tmp_path):
    device = make_device(32)
    tiers = make_tiers(device, disk=tmp_path, host=False)
    hashes, tokens = chain(5, seed=1)
    assert tiers.pins.pin("disk", "pin-d", copies(hashes, tokens, [0, 1, 2, 3, 4]), share=0.5)
    assert tiers.disk.contains_prefix([tiers.epoch.key(hashes[1]), tiers.epoch.key(hashes[3])]) == 2  # no wait()
    other, other_tokens = chain(3, seed=2)
    assert not tiers.pins.pin("disk", "pin-x", copies(other, other_tokens, []), share=0.5)  # neither on disk nor given
    tiers.close()
    reopened = make_tiers(device, disk=tmp_path, host=False)
    assert reopened.pins.pin("disk", "pin-d", copies(hashes, tokens, []), share=0.5)  # at startup: found on disk
    assert load_all(reopened, hashes, tokens, 0, 20) == [20, 21, 22, 23, 24]
    assert all(torch.equal(a, b) for a, b in zip(pages(device, [20, 21, 22, 23, 24]), pages(device, [0, 1, 2, 3, 4])))
    reopened.invalidate_all()  # the chunks are unreachable now: the pin holds nothing, the LRU may take them
    assert reopened.pins.pinned_bytes("disk") == 0 and "pin-d" in reopened.pins
    reopened.close()


def test_page_runs_are_consecutive_ids_in_order():
    assert page_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert page_runs([]) == [] and page_runs([7]) == [(0, 7, 1)]
    assert page_runs([3, 2, 1]) == [(0, 3, 1), (1, 2, 1), (2, 1, 1)]  # a run goes up, one id at a time


def test_a_disk_store_keeps_its_own_name_in_the_catalog(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    name = disk_store_name(first)
    assert name is not None and name == disk_store_name(first)  # kept beside the store
    assert disk_store_name(second) not in (None, name)  # another store, even on the same host
    (second / "store_id").unlink()
    (second / "store_id").mkdir()  # unreadable as an id (as root, a permission error cannot be staged)
    assert disk_store_name(second) is None


def test_a_load_abandoned_while_it_waits_for_a_lend_neither_reads_nor_writes():
    """A load nobody waits for any more (its request was cancelled, or recomputes past its deadline) stops where
    its next slice would start: taken by a worker, it waited for the engine's lend, and there it ends without
    reading its value or writing its pages, which may go then; one still waited for runs to its end."""
    device = make_device()
    tiers = make_tiers(device)
    hashes, tokens = chain(2)
    tiers.demote(copies(hashes, tokens, [0, 1]))
    (found,) = tiers.lookup(ROOT, hashes, tokens, 0)
    untouched = pages(device, [8, 9])
    BACKGROUND_WORK.engine_computes(True)  # an engine computing: loads run only within its lends
    try:
        load = tiers.transfers.submit("gone", found, 0, [8, 9], high=False)
        wait_until(load.future.running)  # a worker took it: it cannot be cancelled, only abandoned
        assert not tiers.transfers.leave(load, "gone")
        BACKGROUND_WORK.lend(60.0)  # returns once no paced task is left to run in it
        assert tiers.transfers.reap() == [load] and load.tier() is None
        assert all(torch.equal(a, b) for a, b in zip(untouched, pages(device, [8, 9])))
        assert tiers.stats()[0].hits == 0
        kept = tiers.transfers.submit("waits", found, 0, [10, 11], high=False)
        while not kept.done:
            BACKGROUND_WORK.lend(60.0)
        assert kept.tier() == "host"
        assert all(torch.equal(a, b) for a, b in zip(pages(device, [0, 1]), pages(device, [10, 11])))
    finally:
        BACKGROUND_WORK.engine_computes(False)
        tiers.close()
