"""The disk tier's tenants, on real LMDB files: each value's owner in its LRU record, share-first eviction
by the cache weights, the per-tenant disk limit, and `order` records written before owners were kept."""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvtierd.storage.disk_store import DiskStore

TINY_MAP = 1 << 20  # holds about eight values of VALUE_BYTES (the slack keeps the rest free)
BIG_MAP = 16 << 20  # never full in these tests
VALUE_BYTES = 64 << 10
A, B = b"tenant-a", b"tenant-b"


def key(owner: bytes, i: int) -> bytes:
    return owner + i.to_bytes(4, "big")


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, VALUE_BYTES, dtype=np.uint8).tobytes()


def put(store: DiskStore, owner: bytes, i: int) -> bool:
    return store.put_many([(key(owner, i), value(i))], owner=owner)


def present(store: DiskStore, owner: bytes, n: int) -> list[int]:
    return [i for i in range(n) if store.contains_prefix([key(owner, i)])]


@pytest.mark.parametrize("shares", [True, False], ids=["shares", "one-lru"])
def test_a_tenant_under_its_share_loses_nothing_while_another_floods(tmp_path: Path, shares: bool) -> None:
    store = DiskStore(tmp_path, map_size=TINY_MAP)
    if shares:
        store.share_by({A: 3.0, B: 1.0}.__getitem__)  # A is entitled to three quarters of the disk
    for i in range(4):
        assert put(store, A, i)
    lost_while_under = []
    for i in range(30):  # B floods: every value it writes is new
        assert put(store, B, i)
        if present(store, A, 4) != [0, 1, 2, 3]:
            lost_while_under.append(i)
    assert store.stats().num_evictions > 0 and store.stats().num_rejected == 0
    flood = present(store, B, 30)
    assert flood == list(range(30 - len(flood), 30))  # B's oldest went first
    if shares:
        assert lost_while_under == []  # A's 4 of about 8 are under its share of 6: only B's values went
        assert store.usage_by_owner()[A].entries == 4
    else:  # one LRU for all: A's values were the oldest, so they went first (the shares are what keeps them)
        assert lost_while_under and present(store, A, 4) == []
    store.close()


def test_the_tenant_above_its_share_loses_its_oldest_values_first(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=TINY_MAP)
    store.share_by({A: 1.0, B: 3.0}.__getitem__)  # A's share is a quarter once B holds values too
    for i in range(8):
        assert put(store, A, i)
    for i in range(5):  # under its share of three quarters: B loses none of these
        assert put(store, B, i)
        assert present(store, B, 5) == list(range(i + 1))
        store.get_many([key(A, j) for j in range(8)])  # A's are the most recently used: one LRU would take B's
    kept = present(store, A, 8)
    assert len(kept) < 8 and kept == list(range(8 - len(kept), 8))  # A's oldest went, its newest stayed
    usage = store.usage_by_owner()
    assert usage[B].entries == 5 and usage[A].entries == len(kept)
    assert usage[A].nbytes == len(kept) * usage[B].nbytes // 5  # equal values, equal charges
    store.close()


def test_a_tenant_past_its_disk_limit_evicts_only_its_own_values(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=BIG_MAP)
    caps: dict[bytes, int] = {}
    store.limit_by(caps.get)  # [qos] tenant_limits disk, for A only
    assert put(store, A, 0) and put(store, B, 0) and put(store, B, 1)
    caps[A] = 3 * store.usage_by_owner()[A].nbytes  # three of its values
    for i in range(1, 7):
        assert put(store, A, i)  # never refused: its own oldest make room
    assert present(store, A, 7) == [4, 5, 6] and present(store, B, 2) == [0, 1]
    assert store.stats().num_evictions == 4  # A's 0 to 3, nothing of B's
    usage = store.usage_by_owner()
    assert (usage[A].entries, usage[A].nbytes, usage[A].over_limit) == (3, caps[A], 0)

    # Pinned values are never evicted: a value they leave no room for is refused, and nothing else goes.
    assert store.pin([key(A, i) for i in (4, 5, 6)]) == 3
    assert not put(store, A, 7)
    assert present(store, A, 8) == [4, 5, 6] and present(store, B, 2) == [0, 1]
    assert store.usage_by_owner()[A].over_limit == 1 and store.stats().num_rejected == 1
    store.unpin([key(A, 4)])
    assert put(store, A, 7) and present(store, A, 8) == [5, 6, 7]

    # A batch larger than the whole limit is refused without evicting anything.
    assert not store.put_many([(key(A, i), value(i)) for i in range(10, 14)], owner=A)
    assert present(store, A, 8) == [5, 6, 7] and store.stats().num_evictions == 5
    assert store.usage_by_owner()[A].over_limit == 2
    store.close()


def test_owners_survive_reopen_with_the_lru_order(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=BIG_MAP)
    for i in range(3):
        assert put(store, A, i)
    assert put(store, B, 0)
    store.get_many([key(A, 0)])  # a read: its new sequence reaches `order` at close, with its owner
    store.close()
    store = DiskStore(tmp_path, map_size=BIG_MAP)
    usage = store.usage_by_owner()
    assert {owner: u.entries for owner, u in usage.items()} == {A: 3, B: 1}
    store.limit_by({A: usage[A].nbytes}.get)  # A may keep what it has: its next value replaces its oldest
    assert put(store, A, 3)
    assert present(store, A, 4) == [0, 2, 3]  # 1 was the oldest after the read of 0
    store.close()


def test_order_records_without_an_owner_still_load_as_unowned(tmp_path: Path) -> None:
    # The layout a store wrote before owners were kept: `order` holds only <Q sequence, Q charge>.
    env = lmdb.open(str(tmp_path), map_size=BIG_MAP, max_dbs=4)
    with env.begin(write=True) as txn:
        values, order = env.open_db(b"values", txn=txn), env.open_db(b"order", txn=txn)
        for seq, i in enumerate((2, 0, 1), start=1):  # written out of key order: the sequences decide
            txn.put(key(b"old", i), value(i), db=values)
            txn.put(key(b"old", i), struct.pack("<QQ", seq, 17 * 4096), db=order)
    env.close()
    store = DiskStore(tmp_path, map_size=BIG_MAP)
    usage = store.usage_by_owner()
    assert set(usage) == {b""} and (usage[b""].entries, usage[b""].nbytes) == (3, 3 * 17 * 4096)
    assert store.get_many([key(b"old", 1)]) == [value(1)]
    store.share_by({b"": 1.0, A: 1.0}.get)  # unowned values are one more owner, weighing 1
    store.limit_by({b"": 3 * 17 * 4096}.get)
    assert store.put_many([(key(b"old", 3), value(3))])  # an owner-less put at the unowned limit
    assert present(store, b"old", 4) == [0, 1, 3]  # the oldest (sequence 1, key 2) went
    store.close()
    store = DiskStore(tmp_path, map_size=BIG_MAP)  # old and new records side by side still load
    assert store.usage_by_owner()[b""].entries == 3
    store.close()


# -- through the engine: [qos] tenant_limits disk reaches the store --------------------------------------


def test_the_engine_caps_a_tenants_disk_bytes_and_leaves_the_others(loaded, make_engine, tmp_path: Path) -> None:
    from kvtierd.engine.config import QosConfig
    from kvtierd.engine.sampling_params import SamplingParams
    from kvtierd.tiers.config import TierConfig

    chunk_bytes = 4 * 16 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 2 * 4
    cap = 2 * chunk_bytes + (1 << 20)  # two full chunks of float32 KV, and room for the pages they are rounded to
    engine = make_engine(kv_tokens=320, tiers=TierConfig(host_bytes=0, disk_bytes=256 << 20, disk_path=tmp_path,
                                                         chunk_pages=4, disk_admission="all"),
                         qos=QosConfig(tenant_disk_bytes={"capped": cap}))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for tenant, topic in [("other", "the block pool"), *(("capped", t) for t in ("pages", "steps", "tiers", "pins"))]:
        text = f"Some notes on {topic}. " + f"They describe {topic} in detail, step by step. " * 9
        rid = engine.add_request(loaded.tokenizer.encode_chat([{"role": "user", "content": text}]), params,
                                 tenant=tenant)
        while engine.has_unfinished():
            engine.step()
        assert rid not in engine.requests
    engine.tiers.wait()  # the disk writer's queue
    usage = engine.tiers.disk.usage_by_owner()
    capped, other = usage[engine._root("capped")], usage[engine._root("other")]
    assert 0 < capped.nbytes <= cap and capped.over_limit == 0
    assert engine.tiers.disk.stats().num_evictions > 0  # the capped tenant's flood evicted its own values
    assert other.entries == 2  # the other tenant's two demoted chunks (one whole, one partial) are still there
    engine.close()
