"""Redis URLs: which topology each names, and the mistakes refused at start (no server needed)."""

from __future__ import annotations

import pytest

from kvtierd.storage.redis_client import RedisTarget, parse_redis_url
from kvtierd.storage.store_errors import StoreArgumentError


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("redis://10.0.0.5:6380/2", "10.0.0.5:6380"),
        ("rediss://:secret@cache.internal", "cache.internal:6379"),
        ("unix:///run/valkey/valkey.sock?db=1", "/run/valkey/valkey.sock"),
    ],
)
def test_single_server_urls_go_to_redis_py_as_they_are(url: str, where: str) -> None:
    assert parse_redis_url(url) == RedisTarget("single", where=where, url=url)


def test_a_cluster_url_is_rewritten_for_redis_py() -> None:
    target = parse_redis_url("redis+cluster://user:pw@10.0.0.1:7000")
    assert (target.topology, target.where, target.url) == ("cluster", "cluster 10.0.0.1:7000", "redis://user:pw@10.0.0.1:7000")
    assert parse_redis_url("rediss+cluster://node-a").url == "rediss://node-a"


def test_a_cluster_has_only_database_0() -> None:
    with pytest.raises(StoreArgumentError, match="only database 0"):
        parse_redis_url("redis+cluster://10.0.0.1:7000/3")


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_credentials() -> None:
    target = parse_redis_url("redis+sentinel://kv:p%40ss@s1:26380,s2,[::1]:26390/kvcache/4")
    assert target == RedisTarget(
        "sentinel", where="sentinel s1:26380,s2:26379,::1:26390/kvcache",
        sentinels=(("s1", 26380), ("s2", 26379), ("::1", 26390)), service_name="kvcache", db=4,
        username="kv", password="p@ss",
    )  # fmt: skip
    assert "p@ss" not in repr(target)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("memcached://host", "unsupported Redis URL scheme"),
        ("localhost:6379", "unsupported Redis URL scheme"),
        ("redis://host:notaport", "bad Redis URL"),
        ("redis+sentinel://s1:26379", "redis\\+sentinel://host"),
        ("redis+sentinel://s1/service/db/extra", "redis\\+sentinel://host"),
        ("redis+sentinel:///service", "redis\\+sentinel://host"),
        ("redis+sentinel://s1:99999/service", "bad sentinel address"),
        ("redis+sentinel://s1/service/x", "database in a Sentinel URL"),
        ("redis+sentinel://s1/service?ssl=true", "no query options"),
    ],
)
def test_bad_urls_are_refused_with_a_hint(url: str, match: str) -> None:
    with pytest.raises(StoreArgumentError, match=match):
        parse_redis_url(url)
