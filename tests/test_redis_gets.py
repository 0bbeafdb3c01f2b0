"""GETs sent at once and read one at a time (storage/redis_gets.py), on a real redis-server: values read in any
order, a connection never given back with replies unread on it, a server that stops between the call and the
reads, and a Cluster's pipeline read at once."""

from __future__ import annotations

from redis_fixtures import RedisFactory, RedisServer
from test_redis_store import key, make_store, value

from kvtierd.storage.redis_gets import PipelinedGets, ReadGets


def test_values_are_read_in_any_order_each_once(empty_redis: RedisServer) -> None:
    store = make_store(empty_redis.url)
    try:
        assert store.put_many([(key(i), value(i)) for i in range(4)])
        gets = store.send_gets([key(0), key(1), key(9), key(3)])
        assert isinstance(gets, PipelinedGets)
        assert store.unseal_many([key(3)], [gets.read(3)]) == [value(3)]  # the replies before it are kept
        assert gets.read(2) is None  # not stored
        assert store.unseal_many([key(0), key(1)], [gets.read(0), gets.read(1)]) == [value(0), value(1)]
        assert gets.read(0) is None  # read once
        assert store.stats().num_gets == 4
    finally:
        store.close()


def test_a_connection_with_replies_unread_is_never_given_back(empty_redis: RedisServer) -> None:
    """The pool hands the last connection given back to the next call: one given back with replies left on it
    would answer that call with another key's value."""
    store = make_store(empty_redis.url)
    try:
        assert store.put_many([(key(i), value(i)) for i in range(5)])
        gets = store.send_gets([key(0), key(1), key(2), key(3)])
        assert store.unseal_many([key(0)], [gets.read(0)]) == [value(0)]
        for i in (1, 2, 3):
            gets.drop(i)  # nobody reads them: the connection goes, its replies with it
        assert store.get_many([key(4)]) == [value(4)]
        other = store.send_gets([key(0), key(1)])
        other.close()
        assert store.get_many([key(1), key(2)]) == [value(1), value(2)]
        assert store.stats().num_failures == 0
    finally:
        store.close()


def test_a_server_that_stops_between_the_call_and_its_reads_answers_none_and_counts(
        redis_factory: RedisFactory) -> None:
    server = redis_factory.server()
    store = make_store(server.url)
    try:
        big = 16 << 20  # two of them are more than the sockets hold: the second cannot have arrived
        assert store.put_many([(key(1), value(1, big)), (key(2), value(2, big))])
        gets = store.send_gets([key(1), key(2)])
        server.pause()
        first, second = gets.read(0), gets.read(1)  # each socket read ends at the op timeout
        assert second is None and (first is None or store.unseal_many([key(1)], [first]) == [value(1, big)])
        assert store.stats().num_failures == 1
        server.resume()
        assert store.get_many([key(2)]) == [value(2, big)]  # a new connection: nothing left of the old one
    finally:
        server.resume()
        store.close()
        server.stop()


def test_a_clusters_values_are_read_in_its_pipeline(redis_factory: RedisFactory) -> None:
    nodes = redis_factory.cluster(3)
    store = make_store(f"redis+cluster://127.0.0.1:{nodes[0].port}")
    try:
        items = [(key(i), value(i)) for i in range(12)]
        assert store.put_many(items)
        gets = store.send_gets([k for k, _ in items])
        assert isinstance(gets, ReadGets)
        assert store.unseal_many([key(7)], [gets.read(7)]) == [value(7)]
        assert store.get_many([k for k, _ in items]) == [v for _, v in items]
    finally:
        store.close()
