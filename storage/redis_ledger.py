"""Per-owner byte limits in the remote tier, kept in Redis itself: every daemon of a fleet shares them.

For each owner (tenant namespace) with a limit, three keys beside its values:

    <keyspace prefix>s<secret id>:o<owner hex>:order   sorted set: value name -> write sequence
    <keyspace prefix>s<secret id>:o<owner hex>:sizes   hash: value name -> sealed bytes
    <keyspace prefix>s<secret id>:o<owner hex>:held    hash: bytes -> sum of the sizes, seq -> last sequence

('o' is no hex digit: these never meet a value's name.) A limited write is one
Lua script (EVALSHA, EVAL on a server that lacks it), so it is atomic across the
daemons: it stores the batch, records it, and then deletes the owner's oldest
written values until the owner is back under its limit. Only names in the
owner's own sorted set are deleted, never another owner's. A batch larger than
the whole limit is not written (counted as over the limit) and nothing is
deleted for it.

Stale entries: a value gone by TTL, by the server's maxmemory policy, or deleted
(a forgotten session, a bad value) keeps its entry and bytes until the eviction
loop reaches it. Then its entry is dropped and nothing real is deleted.
The ledger's keys expire a TTL after the owner's last limited write. By then,
every value it recorded that was not read since has expired too.

Order: oldest *written* first. A read renews a value's TTL (GETEX) but not its
place here, so the limit is first in, first out, not least recently used.

One master only: the script touches the owner's values, which a Cluster spreads
over slots (see redis_store.py), so a limit on a Cluster is refused when it is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.commands.core import Script

from kvtierd.storage.redis_client import RedisClient

# KEYS: order, sizes, held, then the batch's value names. ARGV: limit, ttl, then the sealed values.
# Returns {1, evicted, stale} when stored, {0, 0, 0} for a batch over the whole limit, {-1, 0, 0} when the
# server refused the write for memory (nothing of the batch is left then).
_PUT = """
local order, sizes, held = KEYS[1], KEYS[2], KEYS[3]
local limit, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = #KEYS - 3
local need = 0
for i = 1, n do need = need + string.len(ARGV[i + 2]) end
if need > limit then return {0, 0, 0} end
for i = 1, n do
  local ok = redis.pcall('SET', KEYS[i + 3], ARGV[i + 2], 'EX', ttl)
  if type(ok) == 'table' and ok.err then
    for j = 1, i - 1 do redis.call('UNLINK', KEYS[j + 3]) end
    return {-1, 0, 0}
  end
end
local total = tonumber(redis.call('HGET', held, 'bytes') or '0')
local last = redis.call('HINCRBY', held, 'seq', n)
for i = 1, n do
  local name = KEYS[i + 3]
  total = total - tonumber(redis.call('HGET', sizes, name) or '0') + string.len(ARGV[i + 2])
  redis.call('HSET', sizes, name, string.len(ARGV[i + 2]))
  redis.call('ZADD', order, last - n + i, name)
end
local evicted, stale = 0, 0
while total > limit do
  local oldest = redis.call('ZRANGE', order, 0, 0)[1]
  if oldest == nil or tonumber(redis.call('ZSCORE', order, oldest)) + n > last then break end  -- only the batch left
  total = total - tonumber(redis.call('HGET', sizes, oldest) or '0')
  redis.call('ZREM', order, oldest)
  redis.call('HDEL', sizes, oldest)
  if redis.call('UNLINK', oldest) == 1 then evicted = evicted + 1 else stale = stale + 1 end
end
redis.call('HSET', held, 'bytes', total)
for k = 1, 3 do redis.call('EXPIRE', KEYS[k], ttl) end
return {1, evicted, stale}
"""


@dataclass(frozen=True, slots=True)
class LimitedPut:
    stored: bool
    over_limit: bool  # not stored: the batch alone is larger than the owner's limit
    evicted: int  # the owner's values deleted to make room
    stale: int  # entries of values already gone, dropped


@dataclass(frozen=True, slots=True)
class LedgerUsage:
    entries: int  # recorded values, stale ones included until dropped
    nbytes: int  # their sealed bytes


class RedisLedger:
    def __init__(self, key_prefix: str, ttl_s: int) -> None:
        self._prefix = key_prefix
        self._ttl_s = ttl_s
        self._script: Script | None = None  # made once: it keeps the script's SHA1 for EVALSHA

    def put(self, client: RedisClient, owner: bytes, limit: int, names: Sequence[bytes],
            sealed: Sequence[bytes]) -> LimitedPut:
        """Stores the sealed values under `names` within `owner`'s limit (one script call)."""
        if self._script is None:
            self._script = client.register_script(_PUT)
        code, evicted, stale = self._script(keys=[*self._keys(owner), *names], args=[limit, self._ttl_s, *sealed],
                                            client=client)
        return LimitedPut(code == 1, code == 0, evicted, stale)

    def usage(self, client: RedisClient, owners: Sequence[bytes]) -> list[LedgerUsage]:
        """What each owner's ledger records (one pipeline: ZCARD and HGET per owner)."""
        pipe = client.pipeline(transaction=False)
        for owner in owners:
            order, _, held = self._keys(owner)
            pipe.zcard(order)
            pipe.hget(held, "bytes")
        answers = pipe.execute()
        return [LedgerUsage(int(answers[2 * i]), int(answers[2 * i + 1] or 0)) for i in range(len(owners))]

    def _keys(self, owner: bytes) -> tuple[bytes, bytes, bytes]:
        base = f"{self._prefix}o{owner.hex()}:".encode()
        return base + b"order", base + b"sizes", base + b"held"
