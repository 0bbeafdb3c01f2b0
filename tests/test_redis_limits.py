"""Per-tenant limits in the remote tier on a real redis-server: the ledger lives in Redis, so two daemons'
stores writing for one tenant share its limit; past it only that tenant's oldest values go."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from chunk_fixtures import TINY
from redis_fixtures import RedisFactory, RedisServer
from waiting import wait_until

from kvtierd.server.daemon import remote_config
from kvtierd.server.settings import SettingsError, load_settings
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.store_errors import StoreArgumentError
from kvtierd.storage.value_seal import TAG_BYTES

SECRET = b"fleet secret, 32 bytes long....."
KEYSPACE = RedisKeyspace(fleet="limits", model_fingerprint="f00d", geometry=TINY, chunk_pages=2)
ALICE, BOB = b"alice namespace!", b"bob's namespace!"
VALUE_BYTES = 1000
SEALED = TAG_BYTES + VALUE_BYTES


def key(owner: bytes, i: int) -> bytes:
    return owner[:4] + i.to_bytes(12, "big")


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, VALUE_BYTES, dtype=np.uint8).tobytes()


def make_store(server: RedisServer, limits: dict[bytes, int] | None = None) -> RedisStore:
    store = RedisStore(server.url, KEYSPACE, SECRET, ttl_s=600, op_timeout_ms=2000)
    if limits is not None:
        store.limit_by(limits.get)
    return store


def write(store: RedisStore, owner: bytes, *ids: int) -> bool:
    return store.put_many([(key(owner, i), value(i)) for i in ids], owner=owner)


def stored(store: RedisStore, owner: bytes, ids: range) -> list[int]:
    return [i for i, v in zip(ids, store.get_many([key(owner, i) for i in ids]), strict=True) if v is not None]


@pytest.fixture
def daemons(empty_redis: RedisServer) -> Iterator[tuple[RedisStore, RedisStore]]:
    """Two daemons' stores on one server, both limiting alice to 3 values."""
    limits = {ALICE: 3 * SEALED}
    a, b = make_store(empty_redis, limits), make_store(empty_redis, limits)
    yield a, b
    a.close()
    b.close()


def test_two_daemons_share_one_limit_and_evict_only_the_tenants_oldest(daemons, empty_redis: RedisServer) -> None:
    a, b = daemons
    assert write(b, BOB, 0, 1)  # bob has no limit: a plain write
    for i in range(8):  # alice's values from both daemons, in turn
        assert write((a, b)[i % 2], ALICE, i)
        assert len(stored(a, ALICE, range(8))) == min(i + 1, 3)

    assert stored(b, ALICE, range(8)) == [5, 6, 7]  # her oldest went first, whoever wrote them
    assert stored(a, BOB, range(2)) == [0, 1]  # bob's values were never touched
    assert set(a.usage_by_owner([ALICE, BOB])) == {ALICE}  # bob has no limit, so no ledger
    assert a.usage_by_owner([ALICE]) == b.usage_by_owner([ALICE])  # one ledger for both daemons
    usage = a.usage_by_owner([ALICE])[ALICE]
    assert (usage.entries, usage.nbytes, usage.over_limit) == (3, 3 * SEALED, 0)

    # Rewriting a held value replaces its bytes: nothing else goes.
    assert write(a, ALICE, 6)
    assert stored(a, ALICE, range(8)) == [5, 6, 7]
    assert a.usage_by_owner([ALICE])[ALICE].nbytes == 3 * SEALED


def test_a_batch_over_the_whole_limit_is_refused_and_counted(daemons) -> None:
    a, b = daemons
    assert write(a, ALICE, 0, 1)
    assert not write(b, ALICE, 10, 11, 12, 13)
    assert stored(a, ALICE, range(20)) == [0, 1]  # nothing went for it
    assert b.usage_by_owner([ALICE])[ALICE].over_limit == 1
    assert a.usage_by_owner([ALICE])[ALICE].over_limit == 0  # the count is each daemon's own
    assert b.stats().num_rejected == 1


def test_expired_values_leave_entries_that_free_room_without_evicting(daemons, empty_redis: RedisServer) -> None:
    a, _ = daemons
    assert write(a, ALICE, 0, 1, 2)
    with empty_redis.client() as raw:  # the two oldest expire, as by their TTL
        names = [a.key_prefix.encode() + key(ALICE, i).hex().encode() for i in (0, 1)]
        for name in names:
            raw.pexpire(name, 1)
        wait_until(lambda: not raw.exists(*names), "the two keys expiring", poll_s=0.01)

    assert write(a, ALICE, 3, 4)  # room from the stale entries: value 2 stays
    assert stored(a, ALICE, range(5)) == [2, 3, 4]
    assert a.usage_by_owner([ALICE])[ALICE].entries == 3  # the stale entries were dropped


def test_no_limit_writes_no_ledger(empty_redis: RedisServer) -> None:
    plain, limited = make_store(empty_redis), make_store(empty_redis, {ALICE: 3 * SEALED})
    try:
        assert write(plain, ALICE, 0) and write(limited, BOB, 0)
        with empty_redis.client() as raw:
            assert sorted(raw.keys("*")) == sorted(plain.key_prefix.encode() + key(o, 0).hex().encode()
                                                   for o in (ALICE, BOB))
        assert plain.usage_by_owner([ALICE, BOB]) == {} and limited.usage_by_owner([BOB]) == {}
        assert write(limited, ALICE, 1)
        with empty_redis.client() as raw:
            assert len(raw.keys(f"{limited.key_prefix}o*")) == 3  # alice's ledger: order, sizes, held
    finally:
        plain.close()
        limited.close()


def test_a_cluster_refuses_a_limit() -> None:
    store = RedisStore("redis+cluster://127.0.0.1:1", KEYSPACE, SECRET)
    with pytest.raises(StoreArgumentError, match="one Redis master"):
        store.limit_by(lambda owner: 1 << 20)


def test_a_full_server_refuses_a_limited_write_softly(redis_factory: RedisFactory) -> None:
    server = redis_factory.server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    store = make_store(server, {ALICE: 1 << 30})
    try:
        results = [store.put_many([(key(ALICE, i), value(i) * 16)], owner=ALICE) for i in range(120)]
        assert results[0] and not all(results)
        refused = results.index(False)
        assert store.get_many([key(ALICE, refused)]) == [None]
        assert store.get_many([key(ALICE, 0)]) == [value(0) * 16]  # reads still work on a full server
        stats = store.stats()
        assert stats.num_rejected == results.count(False) and stats.num_failures == 0 and stats.healthy
        usage = store.usage_by_owner([ALICE])[ALICE]
        assert usage.over_limit == 0 and usage.entries == results.count(True)  # refused for memory, unrecorded
    finally:
        store.close()
        server.stop()


def test_a_daemon_refuses_remote_limits_on_a_cluster_at_start(tmp_path) -> None:
    secret = tmp_path / "fleet.key"
    secret.write_bytes(SECRET)
    env = {"KVTIERD_REMOTE_SECRET_FILE": str(secret), "KVTIERD_TENANT_LIMITS": "alice=remote:1GiB"}
    with pytest.raises(SettingsError, match="one Redis master"):
        remote_config(load_settings(None, {**env, "KVTIERD_REMOTE_URL": "redis+cluster://127.0.0.1:1"}))
    assert remote_config(load_settings(None, {**env, "KVTIERD_REMOTE_URL": "redis://127.0.0.1:1"})) is not None
