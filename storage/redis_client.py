"""A Redis/Valkey client from a URL: one server, a Sentinel-managed master, or a Cluster.

    redis://[[user]:password@]host[:port][/db]        one server
    rediss://...                                      one server over TLS
    unix://[[user]:password@]/path/to.sock[?db=N]     one server on a Unix socket
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
                                                      the master that the sentinels name `service`
                                                      (port 26379 by default; the credentials are
                                                      the master's, the sentinels take none)
    redis+cluster://[[user]:password@]host[:port]     a Cluster, found from one of its nodes
    rediss+cluster://...                              a Cluster over TLS

`parse_redis_url` checks a URL when the store is made, so a mistake stops the
daemon at start. `open_client` makes the client when the store first needs it:
single and Sentinel clients connect lazily, a Cluster client reads the slot map
as it is made (so that may fail, and is a call like any other).

Clients never retry by themselves (redis-py retries 3 times with backoff by
default): a failed call fails at once, and the store's circuit breaker decides
when to try again, so a dead server costs one short timeout, not several.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from kvtierd.storage.store_errors import StoreArgumentError

RedisClient: TypeAlias = redis.Redis | RedisCluster
Topology: TypeAlias = Literal["single", "sentinel", "cluster"]

DEFAULT_SENTINEL_PORT = 26379
_SINGLE_SCHEMES = ("redis", "rediss", "unix")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEME = "redis+sentinel"
_HINT = "use redis://, rediss://, unix://, redis+sentinel://host:port/service or redis+cluster://host:port"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    topology: Topology
    where: str  # the server(s), without credentials: for logs and stats
    url: str = field(default="", repr=False)  # single and cluster: what redis-py's from_url reads
    sentinels: tuple[tuple[str, int], ...] = ()
    service_name: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_redis_url(url: str) -> RedisTarget:
    """The target a URL names; raises StoreArgumentError for one that no client could use."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in _SINGLE_SCHEMES:
        options = _redis_py_options(url)
        where = options.get("path") or f"{options.get('host', 'localhost')}:{options.get('port', 6379)}"
        return RedisTarget("single", where=str(where), url=url)
    if scheme in _CLUSTER_SCHEMES:
        # redis-py's cluster client reads redis:// and rediss:// URLs; the scheme only says "cluster" to us.
        rewritten = _CLUSTER_SCHEMES[scheme] + url[len(scheme):]
        options = _redis_py_options(rewritten)
        if options.get("db", 0) != 0:
            raise StoreArgumentError(f"a Redis Cluster has only database 0, the URL names {options['db']}")
        where = f"cluster {options.get('host', 'localhost')}:{options.get('port', 6379)}"
        return RedisTarget("cluster", where=where, url=rewritten)
    if scheme == _SENTINEL_SCHEME:
        return _parse_sentinel_url(url)
    raise StoreArgumentError(f"unsupported Redis URL scheme {scheme or url!r}: {_HINT}")


# What a connection reads off its socket at a time: chunk values are megabytes, and at redis-py's 32 KiB a
# pipeline of eight 12 MB values took 44 ms of the reading thread's CPU (the read loop and hiredis's buffer
# growing), 38 at 1 MiB (a probe on loopback, idle machine; that CPU runs beside the engine's steps).
SOCKET_READ_BYTES = 1 << 20


def open_client(target: RedisTarget, *, connect_timeout_s: float, op_timeout_s: float) -> RedisClient:
    """A client for `target` with these socket timeouts and read size, and no retries of its own."""
    # No handshake: redis-py's (HELLO 3, then CLIENT SETINFO) cost a new connection to a Redis 300 ms away
    # two round trips before its first call (0.9 s against 0.3); RESP2 replies are all the store reads.
    sockets = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": op_timeout_s,
               "socket_read_size": SOCKET_READ_BYTES, "protocol": 2, "driver_info": None}
    if target.topology == "cluster":
        return RedisCluster.from_url(target.url, retry=_no_retry(), **sockets)
    if target.topology == "sentinel":
        sentinel = Sentinel(
            list(target.sentinels),
            sentinel_kwargs={**sockets, "retry": _no_retry()},  # the sentinels themselves: short and once, too
            **sockets,
        )
        return sentinel.master_for(target.service_name, db=target.db, username=target.username,
                                   password=target.password, retry=_no_retry())
    return redis.Redis.from_url(target.url, retry=_no_retry(), **sockets)


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _redis_py_options(url: str) -> dict[str, object]:
    try:
        return parse_url(url)
    except ValueError as e:
        raise StoreArgumentError(f"bad Redis URL: {e}") from None


def _parse_sentinel_url(url: str) -> RedisTarget:
    """redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]; redis-py has no parser for it."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise StoreArgumentError("a redis+sentinel:// URL takes no query options")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = tuple(_host_port(h, DEFAULT_SENTINEL_PORT) for h in hosts.split(",") if h)
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not sentinels or not 1 <= len(path) <= 2:
        raise StoreArgumentError(
            f"a Sentinel URL is redis+sentinel://host[:port][,host[:port]...]/service[/db], got {url!r}"
        )
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise StoreArgumentError(f"the database in a Sentinel URL is a number, got {path[1]!r}") from None
    where = f"sentinel {','.join(f'{h}:{p}' for h, p in sentinels)}/{path[0]}"
    return RedisTarget("sentinel", where=where, sentinels=sentinels, service_name=path[0], db=db,
                       username=unquote(username) or None, password=unquote(password) or None)


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    """host, host:port, [v6] or [v6]:port."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or (port and not port.isdigit()) or (port and not 0 < int(port) < 65536):
        raise StoreArgumentError(f"bad sentinel address {text!r}: host[:port] or [v6 address][:port]")
    return host, int(port) if port else default_port
