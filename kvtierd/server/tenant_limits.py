"""Per-tenant limits (`[qos] tenant_limits`): stored sessions, requests in flight, KV bytes in the host, disk
and remote tiers.

    tenant_limits = "alice=sessions:100 inflight:4 host:256MiB disk:4GiB remote:1GiB, *=inflight:16"

`*` applies to every tenant not named. Past `sessions` or `inflight`, a request gets 429 naming the limit
and its value; nothing stored is touched (the session is not created, the request is not queued). `host`
is not refused but kept: a tenant holding its limit in host slots evicts its own least recently used chunk
for its next one (storage/host_store.py), so its host share goes before anyone else's. So is `disk`: past
it, the tenant's own least recently used values go to make room for its next (storage/disk_store.py); a
chunk that its pinned values leave no room for is not written (counted), and the request is served anyway.
`remote` is the same in the fleet's Redis, counted there across every daemon that writes the tenant's values
(storage/redis_ledger.py); its oldest written values go first.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from kvtierd.server.errors import ApiError

ANY_TENANT = "*"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    sessions: int | None = None  # sessions in the session store
    inflight: int | None = None  # requests being served at once
    host: int | None = None  # bytes of KV chunks in the host tier
    disk: int | None = None  # bytes of KV values in the disk tier (as stored: encoded, rounded to pages)
    remote: int | None = None  # bytes of KV values in the remote tier, fleet-wide (as sent: encoded and sealed)


NO_LIMITS = TenantLimits()


def parse_tenant_limits(value: Any, parse_bytes=int) -> dict[str, TenantLimits]:
    """`"alice=sessions:100 inflight:4 host:256MiB disk:4GiB remote:1GiB, *=inflight:16"` -> tenant -> its
    limits."""
    out: dict[str, TenantLimits] = {}
    names = {f.name for f in fields(TenantLimits)}
    for item in filter(None, (i.strip() for i in str(value).split(","))):
        tenant, _, spec = item.partition("=")
        limits: dict[str, int] = {}
        for part in spec.split():
            name, _, number = part.partition(":")
            if name not in names or name in limits:
                raise ValueError(f"{item!r}: name each of {', '.join(sorted(names))} at most once, as name:number")
            n = parse_bytes(number) if name in ("host", "disk", "remote") else int(number) if number.isdigit() else -1
            if not n > 0:
                raise ValueError(f"{item!r}: {name} must be a positive number")
            limits[name] = n
        if not tenant.strip() or not limits:
            raise ValueError(f"{item!r} is not tenant=name:number ... (names: {', '.join(sorted(names))})")
        out[tenant.strip()] = TenantLimits(**limits)
    return out


def limits_of(table: dict[str, TenantLimits], tenant: str) -> TenantLimits:
    return table.get(tenant) or table.get(ANY_TENANT) or NO_LIMITS


def limit_exceeded(tenant: str, what: str, limit: int, detail: str) -> ApiError:
    return ApiError(429, f"tenant {tenant!r} is at its limit of {limit} {detail} ([qos] tenant_limits {what}); "
                    f"{'delete a session first' if what == 'sessions' else 'retry when one finishes'}",
                    type="rate_limit_error", param=None, code=f"tenant_{what}_limit",
                    headers={} if what == "sessions" else {"Retry-After": "1"})


class InFlight:
    """Requests each tenant has being served; `admit` refuses one past the tenant's `inflight` limit."""

    def __init__(self) -> None:
        self._by_tenant: Counter[str] = Counter()

    @contextmanager
    def admit(self, tenant: str, limits: TenantLimits) -> Iterator[None]:
        if limits.inflight is not None and self._by_tenant[tenant] >= limits.inflight:
            raise limit_exceeded(tenant, "inflight", limits.inflight, "requests in flight")
        self._by_tenant[tenant] += 1
        try:
            yield
        finally:
            self._by_tenant[tenant] -= 1
            if not self._by_tenant[tenant]:
                del self._by_tenant[tenant]


async def check_session_room(tenant: str, limits: TenantLimits, count_sessions) -> None:
    """Refuses a new session past the tenant's `sessions` limit; `count_sessions(tenant, limit)` counts
    up to `limit` of them (a blocking store call, run on a thread)."""
    if limits.sessions is None:
        return
    n = len(await asyncio.to_thread(count_sessions, tenant, limits.sessions))
    if n >= limits.sessions:
        raise limit_exceeded(tenant, "sessions", limits.sessions, "stored sessions")
