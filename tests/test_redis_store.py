"""The remote tier on real redis-server processes: round trips, keyspaces, forged values, TTLs,
a server that dies, hangs or fills up, and Cluster and Sentinel deployments."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from chunk_fixtures import TINY, make_identity, make_payload
from fake_clock import FakeClock
from redis_fixtures import GatedProxy, RedisFactory, RedisServer

from kvtierd.storage.circuit_breaker import CircuitBreaker
from kvtierd.storage.codecs import SLICE_BYTES
from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import decode_frame, encode_frame
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.store_errors import StoreArgumentError

SECRET = b"fleet secret, 32 bytes long....."
OTHER_SECRET = b"another fleet's secret, 32 bytes"
KEYSPACE = RedisKeyspace(fleet="test", model_fingerprint="f00d", geometry=TINY, chunk_pages=2)
TTL_S = 600
OP_TIMEOUT_MS = 300
# An idle redis-server already takes ~960 KB of its own: 1mb would leave no room for one batch.
MAXMEMORY = "2mb"
BF16 = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.bfloat16)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value(i: int, nbytes: int = 1000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def make_store(url: str, keyspace: RedisKeyspace = KEYSPACE, secret: bytes = SECRET, **options) -> RedisStore:
    options.setdefault("op_timeout_ms", OP_TIMEOUT_MS)
    return RedisStore(url, keyspace, secret, ttl_s=TTL_S, **options)


@pytest.fixture
def store(empty_redis: RedisServer) -> Iterator[RedisStore]:
    s = make_store(empty_redis.url)
    yield s
    s.close()


def name_of(store: RedisStore, chunk_key: bytes) -> bytes:
    return store.key_prefix.encode() + chunk_key.hex().encode()


# -- the ChunkStore contract ------------------------------------------------------------------


def test_frames_round_trip(store: RedisStore) -> None:
    identities = [make_identity(pages=2, seed=s) for s in range(3)]
    frames = {i.block_hashes[-1]: (i, encode_frame(i, make_payload(i, seed=n))) for n, i in enumerate(identities)}
    assert store.put_many([(k, frame) for k, (_, frame) in frames.items()])

    got = store.get_many(list(frames))
    for (identity, frame), stored in zip(frames.values(), got, strict=True):
        assert stored == frame
        assert decode_frame(stored, identity).payload == make_payload(identity, seed=identities.index(identity))


def test_put_get_contains_delete(store: RedisStore) -> None:
    assert store.put_many([(key(i), value(i)) for i in range(3)])
    assert store.get_many([key(0), key(9), key(2)]) == [value(0), None, value(2)]
    assert store.contains_prefix([key(0), key(1), key(2)]) == 3
    assert store.contains_prefix([key(0), key(9), key(2)]) == 1
    assert store.contains_each([key(9), key(2), key(0)]) == [False, True, True]  # past a miss too
    assert store.delete_many([key(1), key(9)]) == 1
    assert store.contains_prefix([key(0), key(1)]) == 1
    stats = store.stats()
    assert (stats.num_puts, stats.num_gets, stats.num_hits, stats.num_failures) == (3, 3, 2, 0)
    assert stats.healthy and stats.reason is None
    assert stats.num_entries == 3  # the server's figures, read with the first put (every 5 s at most)
    store.refresh_usage()
    assert store.stats().num_entries == 2 and store.stats().bytes_used > 0


def test_reads_never_ask_the_server_for_its_figures_and_the_epochs_reads_do(empty_redis: RedisServer,
                                                                          monkeypatch) -> None:
    # A read's INFO round trip ran inside its load's paced slice: through a slow Redis the lending step waited
    # for it.
    monkeypatch.setattr("kvtierd.storage.redis_store.USAGE_INTERVAL_S", 3600.0)  # however slow this machine
    looks = 0

    def infos() -> int:
        """INFO calls the server answered, but this function's own."""
        nonlocal looks
        with empty_redis.client() as raw:
            calls = raw.info("commandstats").get("cmdstat_info", {}).get("calls", 0)
        looks += 1
        return calls - (looks - 1)

    writer, reader = make_store(empty_redis.url), make_store(empty_redis.url)
    assert writer.put_many([(key(i), value(i)) for i in range(3)])
    before = infos()
    assert reader.get_many([key(0), key(1)]) == [value(0), value(1)]
    assert reader.unseal_many([key(2)], reader.get_sealed([key(2)])) == [value(2)]
    assert infos() == before and reader.stats().num_entries == 0  # never read: its figures are not known yet
    assert reader.read_epoch() == 0
    assert infos() == before + 1 and reader.stats().num_entries == 3
    assert reader.read_epoch() == 0 and infos() == before + 1  # not again within USAGE_INTERVAL_S
    writer.close()
    reader.close()


def test_a_key_given_twice_keeps_its_last_value_and_empty_batches_cost_nothing(store: RedisStore) -> None:
    assert store.put_many([(key(1), b"first"), (key(1), b"second")])
    assert store.get_many([key(1)]) == [b"second"]
    assert store.put_many([]) and store.get_many([]) == [] and store.contains_prefix([]) == 0
    assert store.contains_each([]) == []
    assert store.delete_many([]) == 0
    assert store.stats().num_gets == 1


def test_a_bad_key_is_the_callers_bug(store: RedisStore) -> None:
    with pytest.raises(ValueError, match="1 to 255 bytes"):
        store.put_many([(b"", b"x")])
    assert store.stats().healthy


def test_threads_share_one_store(store: RedisStore) -> None:
    def work(t: int) -> None:
        for i in range(t * 100, t * 100 + 30):
            assert store.put_many([(key(i), value(i))])
            assert store.get_many([key(i)]) == [value(i)]

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    assert store.stats().num_puts == 120 and store.stats().num_hits == 120


# -- keys -------------------------------------------------------------------------------------


def test_the_key_prefix_names_fleet_model_geometry_chunk_size_frame_version_and_secret(
        empty_redis: RedisServer, store: RedisStore) -> None:
    assert store.key_prefix.startswith("kvtierd:v1:test:f00d:2x1x4x4-float16:n2:f1:s")
    assert len(store.key_prefix.rpartition(":s")[2]) == len("01234567:")
    store.put_many([(key(7), value(7))])
    with empty_redis.client() as raw:
        assert raw.keys("*") == [name_of(store, key(7))]


@pytest.mark.parametrize(
    "other",
    [
        RedisKeyspace(fleet="test", model_fingerprint="beef", geometry=TINY, chunk_pages=2),
        RedisKeyspace(fleet="test", model_fingerprint="f00d", chunk_pages=2, geometry=BF16),
        RedisKeyspace(fleet="test", model_fingerprint="f00d", geometry=TINY, chunk_pages=4),
        RedisKeyspace(fleet="staging", model_fingerprint="f00d", geometry=TINY, chunk_pages=2),
    ],
    ids=["fingerprint", "dtype", "chunk_pages", "fleet"],
)
def test_other_keyspaces_never_see_each_others_values(empty_redis: RedisServer, other: RedisKeyspace) -> None:
    ours, theirs = make_store(empty_redis.url), make_store(empty_redis.url, other)
    assert ours.key_prefix != theirs.key_prefix
    assert ours.put_many([(key(1), b"ours")])
    assert theirs.get_many([key(1)]) == [None] and theirs.contains_prefix([key(1)]) == 0
    assert theirs.put_many([(key(1), b"theirs")])
    assert ours.get_many([key(1)]) == [b"ours"] and theirs.get_many([key(1)]) == [b"theirs"]
    assert ours.stats().num_corrupt == theirs.stats().num_corrupt == 0


def test_every_key_gets_the_ttl_and_a_hit_renews_it(empty_redis: RedisServer, store: RedisStore) -> None:
    assert store.put_many([(key(i), value(i)) for i in range(5)])
    with empty_redis.client() as raw:
        ttls = [raw.ttl(name_of(store, key(i))) for i in range(5)]
        assert all(TTL_S - 5 <= t <= TTL_S for t in ttls), ttls
        raw.expire(name_of(store, key(0)), 10)
        store.get_many([key(0)])
        assert raw.ttl(name_of(store, key(0))) > TTL_S - 5


# -- forged values ----------------------------------------------------------------------------


def test_a_value_tampered_in_redis_is_refused_removed_and_counted(empty_redis: RedisServer, store: RedisStore) -> None:
    identity = make_identity(pages=2)
    chunk_key = identity.block_hashes[-1]
    store.put_many([(chunk_key, encode_frame(identity, make_payload(identity))), (key(2), value(2))])
    with empty_redis.client() as raw:
        sealed = bytearray(raw.get(name_of(store, chunk_key)))
        sealed[-1] ^= 0x01  # one payload bit
        raw.set(name_of(store, chunk_key), bytes(sealed))

    assert store.get_many([chunk_key, key(2)]) == [None, value(2)]
    with empty_redis.client() as raw:
        assert not raw.exists(name_of(store, chunk_key))
    stats = store.stats()
    assert (stats.num_corrupt, stats.num_hits, stats.num_quarantined, stats.healthy) == (1, 1, 0, True)


def test_a_read_calls_between_after_the_get_and_between_slices_of_the_tag_check(empty_redis: RedisServer,
                                                                               store: RedisStore) -> None:
    """A paced load yields in `between`; the value it reads is the same, and a tampered one is still refused."""
    big = value(1, 3 * SLICE_BYTES)
    store.put_many([(key(1), big)])
    calls: list[int] = []
    assert store.get_many([key(1)], lambda: calls.append(1)) == [big]
    assert len(calls) == 1 + 3  # after the GET, then after each MiB of the tag's hash
    with empty_redis.client() as raw:
        sealed = bytearray(raw.get(name_of(store, key(1))))
        sealed[-1] ^= 0x01
        raw.set(name_of(store, key(1)), bytes(sealed))
    assert store.get_many([key(1)], lambda: None) == [None]


def test_a_read_waits_for_the_server_inside_the_callers_waiting(empty_redis: RedisServer) -> None:
    """A paced load puts `waiting` around the round trip (it waits for Redis beside the steps, holding no slice):
    the GET is sent and answered inside it, the tag checks come after it."""
    proxy = GatedProxy(empty_redis.port)
    store = make_store(proxy.url)
    try:
        assert store.put_many([(key(1), value(1))])
        events: list[str] = []

        def release_once_held() -> None:
            while not proxy.held:
                time.sleep(0.001)
            proxy.release()

        @contextmanager
        def waiting() -> Iterator[None]:
            proxy.hold()  # the GET sent inside waits here until the test's thread sees it held
            releaser = threading.Thread(target=release_once_held)
            releaser.start()
            yield
            releaser.join()
            events.append(f"waited: {proxy.held} call held")

        assert store.get_many([key(1)], lambda: events.append("between"), waiting) == [value(1)]
        assert events[0] == "waited: 1 call held" and events[1:] == ["between"] * (len(events) - 1) != []
    finally:
        store.close()
        proxy.close()


def test_a_value_sealed_under_another_secret_is_refused(empty_redis: RedisServer) -> None:
    ours, theirs = make_store(empty_redis.url), make_store(empty_redis.url, secret=OTHER_SECRET)
    assert ours.key_prefix != theirs.key_prefix  # a rotation under way: disjoint keys, no fight
    assert theirs.put_many([(key(1), value(1))])
    assert ours.get_many([key(1)]) == [None] and ours.stats().num_corrupt == 0
    with empty_redis.client() as raw:  # planted under our key
        raw.set(name_of(ours, key(1)), raw.get(name_of(theirs, key(1))))
    assert ours.get_many([key(1)]) == [None]
    assert ours.stats().num_corrupt == 1
    assert theirs.get_many([key(1)]) == [value(1)]


def test_a_value_moved_to_another_key_is_refused(empty_redis: RedisServer, store: RedisStore) -> None:
    store.put_many([(key(1), value(1))])
    with empty_redis.client() as raw:
        raw.set(name_of(store, key(2)), raw.get(name_of(store, key(1))))
        raw.set(name_of(store, key(3)), b"short")  # shorter than a tag
    assert store.get_many([key(2), key(3), key(1)]) == [None, None, value(1)]
    assert store.stats().num_corrupt == 2


def test_quarantine_deletes_a_value_the_caller_found_bad(store: RedisStore) -> None:
    store.put_many([(key(1), value(1))])
    assert store.quarantine(key(1), "token ids: the frame's token ids differ")
    assert store.get_many([key(1)]) == [None]
    assert not store.quarantine(key(1), "reported twice")  # nothing left; counted anyway
    assert store.stats().num_corrupt == 2


# -- a server that fails ----------------------------------------------------------------------


def test_a_dead_server_gives_misses_opens_the_breaker_and_heals_after_a_restart(redis_factory: RedisFactory) -> None:
    server = redis_factory.server()
    clock = FakeClock()
    store = make_store(server.url, breaker=CircuitBreaker(failure_threshold=3, backoff_s=5.0, clock=clock))
    assert store.put_many([(key(1), value(1))])
    server.stop()

    assert store.get_many([key(1), key(2)]) == [None, None]
    assert store.contains_prefix([key(1)]) == 0
    assert store.stats().healthy  # two failures: not yet
    assert not store.put_many([(key(3), value(3))])
    stats = store.stats()
    assert not stats.healthy and stats.num_failures == 3
    assert f"127.0.0.1:{server.port} unreachable, circuit open" in stats.reason and "ConnectionError" in stats.reason

    for _ in range(100):  # while open: answered without touching the network (shown below: a live server is not asked)
        assert store.get_many([key(1)]) == [None] and store.delete_many([key(1)]) == 0
    assert store.stats().num_failures == 203

    server.start()  # same port; its values are gone (no persistence)
    assert store.get_many([key(1)]) == [None] and not store.stats().healthy  # still open: the backoff runs
    clock.advance(5.0)
    assert store.put_many([(key(4), value(4))])  # the half-open probe
    assert store.stats().healthy and store.get_many([key(4)]) == [value(4)]
    store.close()
    server.stop()


def test_a_hung_server_costs_one_op_timeout_per_call(redis_factory: RedisFactory) -> None:
    server = redis_factory.server()
    store = make_store(server.url, breaker=CircuitBreaker(failure_threshold=2, clock=FakeClock()))
    assert store.put_many([(key(1), value(1))])
    server.pause()
    try:
        for call in (lambda: store.get_many([key(1)]), lambda: store.put_many([(key(2), value(2))])):
            assert call() in ([None], False)  # the op timeout ends the wait: a miss, not a hang
        stats = store.stats()
        assert not stats.healthy and "TimeoutError" in stats.reason
    finally:
        server.resume()
    store.close()
    server.stop()


def test_a_full_server_under_noeviction_refuses_puts_softly(redis_factory: RedisFactory) -> None:
    server = redis_factory.server("--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction")
    store = make_store(server.url)
    batches = [[(key(b * 4 + i), value(b * 4 + i, 16_000)) for i in range(4)] for b in range(40)]
    results = [store.put_many(batch) for batch in batches]
    assert results[0] and not all(results)
    refused = batches[results.index(False)]
    assert store.contains_prefix([k for k, _ in refused[:1]]) == 0
    assert store.get_many([k for k, _ in refused]) == [None] * 4  # undone: none of the batch is left
    assert store.get_many([key(0)]) == [value(0, 16_000)]  # reads still work on a full server
    stats = store.stats()
    assert stats.num_rejected == results.count(False) and stats.num_failures == 0 and stats.healthy
    store.close()
    server.stop()


def test_a_full_server_under_allkeys_lru_evicts_instead(redis_factory: RedisFactory) -> None:
    server = redis_factory.server("--maxmemory", MAXMEMORY, "--maxmemory-policy", "allkeys-lru")
    store = make_store(server.url)
    for i in range(150):
        assert store.put_many([(key(i), value(i, 16_000))])
    assert store.get_many([key(149)]) == [value(149, 16_000)]
    kept = [v is not None for v in store.get_many([key(i) for i in range(150)])]
    # Which ones went is the server's choice, not the store's: its LRU clock ticks once a second, so
    # keys written within one second look equally old to it.
    assert 20 < sum(kept) < 100
    usage = store.refresh_usage()
    assert usage is not None and usage.num_evictions > 0 and usage.max_bytes == 2 << 20
    stats = store.stats()
    assert stats.num_evictions == usage.num_evictions and stats.capacity_bytes == 2 << 20
    assert stats.num_rejected == 0 and stats.healthy
    store.close()
    server.stop()


def test_a_closed_store_answers_misses(empty_redis: RedisServer) -> None:
    store = make_store(empty_redis.url)
    store.put_many([(key(1), value(1))])
    store.close()
    assert store.get_many([key(1)]) == [None] and not store.put_many([(key(2), value(2))])
    assert store.stats().reason == "closed" and not store.stats().healthy


def test_mistakes_stop_the_store_at_start() -> None:
    with pytest.raises(StoreArgumentError, match="at least 16"):
        RedisStore("redis://127.0.0.1", KEYSPACE, b"short")
    with pytest.raises(StoreArgumentError, match="unsupported Redis URL scheme"):
        RedisStore("http://127.0.0.1", KEYSPACE, SECRET)
    with pytest.raises(StoreArgumentError, match="positive"):
        RedisStore("redis://127.0.0.1", KEYSPACE, SECRET, ttl_s=0)
    with pytest.raises(StoreArgumentError, match="fleet"):
        RedisKeyspace(fleet="a:b", model_fingerprint="f00d", geometry=TINY, chunk_pages=2)


def test_a_store_on_an_unreachable_address_is_made_and_answers_misses() -> None:
    store = make_store("redis://127.0.0.1:1", connect_timeout_ms=100)
    assert store.get_many([key(1)]) == [None] and store.stats().num_failures == 1


# -- Cluster and Sentinel ---------------------------------------------------------------------


def test_a_cluster_spreads_keys_over_its_masters(redis_factory: RedisFactory) -> None:
    nodes = redis_factory.cluster(3)
    store = make_store(f"redis+cluster://127.0.0.1:{nodes[0].port}")
    items = [(key(i), value(i)) for i in range(60)]
    assert store.put_many(items)
    assert store.get_many([k for k, _ in items]) == [v for _, v in items]
    assert store.contains_prefix([key(0), key(1), key(999)]) == 2
    per_node = []
    for node in nodes:
        with node.client() as raw:
            per_node.append(raw.dbsize())
    assert sum(per_node) == 60 and all(n > 5 for n in per_node), per_node  # one slot per key, not one node
    usage = store.refresh_usage()
    assert usage is not None and usage.num_keys == 60
    assert store.delete_many([k for k, _ in items[:10]]) == 10
    store.close()


def test_a_sentinel_url_reaches_the_master(redis_factory: RedisFactory) -> None:
    master = redis_factory.server()
    sentinel = redis_factory.sentinel(master, "kvcache")
    store = make_store(f"redis+sentinel://127.0.0.1:{sentinel.port}/kvcache")
    assert store.put_many([(key(1), value(1))])
    assert store.get_many([key(1)]) == [value(1)]
    with master.client() as raw:
        assert raw.exists(name_of(store, key(1)))
    store.close()


def test_the_fleet_epoch_starts_at_zero_and_moves_for_every_store_of_the_keyspace(empty_redis: RedisServer) -> None:
    a, b = make_store(empty_redis.url), make_store(empty_redis.url)
    try:
        assert a.read_epoch() == b.read_epoch() == 0
        assert a.bump_epoch() == 1
        assert b.read_epoch() == 1  # another host sees it
        other = make_store(empty_redis.url, RedisKeyspace("other-fleet", "model-a", KEYSPACE.geometry, 16))
        assert other.read_epoch() == 0
        other.close()
    finally:
        a.close()
        b.close()


def test_the_epoch_of_a_server_that_is_down_is_unknown(redis_factory: RedisFactory) -> None:
    server = redis_factory.server()
    s = make_store(server.url)
    server.stop()
    assert s.read_epoch() is None and s.bump_epoch() is None
    s.close()
