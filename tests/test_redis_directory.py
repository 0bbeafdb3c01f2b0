"""The remote tier's directory on real redis-server processes: what a keyspace holds, known without a round trip
(storage/redis_directory.py): filled by a scan, kept by other hosts' announcements and this host's own calls,
emptied when its server goes away, refilled when it returns, on one server and on a Cluster."""

from __future__ import annotations

import redis
from redis_fixtures import GatedProxy, RedisFactory, RedisServer
from test_redis_store import KEYSPACE, OTHER_SECRET, key, make_store, name_of, value
from waiting import wait_until

from kvtierd.storage.redis_directory import RedisDirectory
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_store import RedisStore


def test_it_knows_what_was_stored_before_it_and_hears_what_other_hosts_store_after(empty_redis: RedisServer) -> None:
    other_keyspace = RedisKeyspace("other", "f00d", KEYSPACE.geometry, 2)
    writer, other_fleet, other_secret = (make_store(empty_redis.url), make_store(empty_redis.url, other_keyspace),
                                         make_store(empty_redis.url, secret=OTHER_SECRET))
    reader = make_store(empty_redis.url)
    try:
        assert writer.put_many([(key(1), value(1)), (key(2), value(2))])
        assert other_fleet.put_many([(key(3), value(3))]) and other_secret.put_many([(key(4), value(4))])
        assert writer.bump_epoch() == 1  # the keyspace's epoch: a name beside the values, no chunk
        assert reader.known_each([key(1)]) is None  # not following: lookups ask the server
        directory = following(reader)
        assert reader.known_each([key(1), key(2), key(3), key(4)]) == [True, True, False, False]
        assert directory.num_keys == 2

        with empty_redis.client() as raw:
            raw.publish(reader.announce_channel, b"zz not-hex")  # nothing a store sends: skipped
        assert writer.put_many([(key(5), value(5))])  # another host stores: announced on the keyspace's channel
        assert other_fleet.put_many([(key(6), value(6))])
        wait_until(lambda: reader.known_each([key(5)]) == [True], "the other host's announcement")
        assert reader.known_each([key(6)]) == [False]
    finally:
        for s in (writer, other_fleet, other_secret, reader):
            s.close()


def test_a_complete_directory_answers_while_the_server_does_not(empty_redis: RedisServer) -> None:
    proxy = GatedProxy(empty_redis.port)
    writer, reader = make_store(empty_redis.url), make_store(proxy.url)
    try:
        assert writer.put_many([(key(1), value(1))])
        directory = following(reader)
        proxy.hold()
        assert reader.known_each([key(1), key(2)]) == [True, False]
        assert reader.contains_each([key(1)]) == [False]  # asked, the held server answers nothing in time
        assert proxy.held == 1
    finally:
        proxy.release()
        writer.close()
        reader.close()
        proxy.close()


def test_its_own_stores_hits_and_deletes_count_at_once(empty_redis: RedisServer) -> None:
    store = make_store(empty_redis.url)
    try:
        directory = following(store)
        assert store.put_many([(key(1), value(1)), (key(2), value(2)), (key(3), value(3))])
        assert store.known_each([key(1), key(2), key(3)]) == [True, True, True]
        assert store.delete_many([key(1)]) == 1 and store.quarantine(key(2), "a test")
        assert store.known_each([key(1), key(2), key(3)]) == [False, False, True]
        with empty_redis.client() as raw:  # a host without the secret plants a value, unannounced
            raw.set(name_of(store, key(7)), b"forged")
        directory.add([key(7)])
        assert store.get_many([key(7)]) == [None]  # refused, deleted: no longer known
        assert store.known_each([key(7)]) == [False]
    finally:
        store.close()


def test_a_value_gone_unannounced_stays_known_until_the_next_scan(empty_redis: RedisServer) -> None:
    store = make_store(empty_redis.url)
    assert store.put_many([(key(1), value(1)), (key(2), value(2))])
    with empty_redis.client() as raw:
        scans = _count_scans(raw)
        directory = _directory(empty_redis, store, rescan_s=3600)
        rescanning = _directory(empty_redis, store, rescan_s=0.0)
        try:
            wait_until(lambda: directory.complete and rescanning.complete, "the directories' first scans")
            raw.delete(name_of(store, key(1)))  # as the server's memory policy or an expiry would
            assert directory.holds_each([key(1), key(2)]) == [True, True]  # a hint: the load's GET misses
            since = scans()
            wait_until(lambda: scans() >= since + 2, "a scan begun after the delete, and ended")
            assert rescanning.holds_each([key(1), key(2)]) == [False, True]
            assert directory.holds_each([key(1)]) == [True]
        finally:
            directory.close()
            rescanning.close()
    store.close()


def test_a_server_that_goes_away_empties_it_and_its_return_fills_it_again(redis_factory: RedisFactory) -> None:
    server = redis_factory.server()
    writer, reader = make_store(server.url), make_store(server.url)
    try:
        assert writer.put_many([(key(1), value(1))])
        directory = following(reader)
        server.stop()
        wait_until(lambda: not directory.complete, "the directory noticing its server gone")
        assert reader.known_each([key(1)]) is None  # lookups ask the server again
        server.start()  # same port; nothing kept (no persistence)
        wait_until(lambda: directory.complete, "the directory following again")
        assert reader.known_each([key(1)]) == [False]
        assert writer.put_many([(key(2), value(2))])
        wait_until(lambda: reader.known_each([key(2)]) == [True], "the announcement after the return")
    finally:
        writer.close()
        reader.close()
        server.stop()


def test_past_its_limit_it_gives_up_and_lookups_ask(empty_redis: RedisServer) -> None:
    store = make_store(empty_redis.url)
    assert store.put_many([(key(i), value(i, 10)) for i in range(3)])
    directory = _directory(empty_redis, store, max_keys=2)
    try:
        wait_until(lambda: directory.too_many, "the directory giving up")
        assert directory.holds_each([key(0)]) is None and not directory.complete
    finally:
        directory.close()
        store.close()


def test_on_a_cluster_it_scans_every_master_and_hears_every_store(redis_factory: RedisFactory) -> None:
    nodes = redis_factory.cluster(3)
    url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
    writer, reader = make_store(url), make_store(url)
    try:
        items = [(key(i), value(i, 10)) for i in range(60)]
        assert writer.put_many(items[:30])
        directory = following(reader)
        assert directory.num_keys == 30
        assert writer.put_many(items[30:])  # spread over the three masters; announced once, heard by all
        wait_until(lambda: directory.num_keys == 60, "the announcements of the later stores")
        assert reader.known_each([key(0), key(59), key(60)]) == [True, True, False]
    finally:
        writer.close()
        reader.close()


def _count_scans(raw: redis.Redis):
    """SCAN calls the server has run since now (its command stats)."""
    def calls() -> int:
        return int(raw.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
    start = calls()
    return lambda: calls() - start



def following(store: RedisStore) -> RedisDirectory:
    """`store`'s directory, started and complete."""
    directory = store.follow()
    wait_until(lambda: directory.complete, "the directory's first scan")
    return directory


def _directory(server: RedisServer, store, **options) -> RedisDirectory:
    """A directory of `store`'s keyspace with options the store's own does not take."""
    return RedisDirectory(lambda: redis.Redis(host="127.0.0.1", port=server.port), store.announce_channel,
                          store.key_prefix.encode(), **options)
