"""/admin/pins: pin a prefix or a session on the device, the host or the disk tier, list pins, unpin; pins
outlive restarts.

A pin is kept in the engine (`cache/pins.py`) and in the SQL store; at startup
`restore_pins` pins again what the store holds: a device pin of a session waits
for its next turn, a prefix not cached any more is computed again from its token
ids; a disk pin finds its chunks still on disk.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime, timedelta

from aiohttp import web

from kvtierd.cache.pins import Pin, PinError
from kvtierd.engine.llm_engine import PUBLIC_NAMESPACE
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.server.errors import ApiError, bad_request, not_found
from kvtierd.server.generation import Generation
from kvtierd.server.middleware import read_json
from kvtierd.server.prefix_routes import PREFIX_FIELDS, prefix_tokens, tenant_param
from kvtierd.server.schemas import require_object
from kvtierd.server.session_routes import session_tenant
from kvtierd.server.state import STATE, DaemonState
from kvtierd.storage.session_store import PinRecord
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.tier_pins import PIN_TIERS

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

MAX_TTL_S = 10 * 365 * 86400  # longer is "until unpinned"; this bound keeps expiry times representable


def pin_json(state: DaemonState, pin: Pin) -> dict:
    eng = state.engine.engine
    tenant = eng.namespaces.get(pin.root, "")
    return {
        "id": pin.pin_id, "kind": pin.kind, "tenant": "public" if tenant == PUBLIC_NAMESPACE else tenant,
        "session_id": pin.session_id, "pages": len(pin.block_ids),
        "num_tokens": len(pin.token_ids) if pin.kind == "prefix" else None, "tier": pin.tier,
        "bytes": _below(state).pins[pin.pin_id].nbytes if pin.tier != "device" else None,
        "expires_in_s": None if pin.expires_at is None else round(pin.expires_at - time.monotonic(), 3),
    }


def budget_json(state: DaemonState) -> dict:
    """Device pins count pages; host and disk pins count bytes, against the same share of each tier."""
    kv = state.engine.engine.kv
    budget = {"budget_pages": kv.pins.budget_pages, "pinned_pages": kv.pool.num_pinned_blocks}
    share = kv.pins.budget_pages / kv.pool.num_blocks
    for t in state.engine.engine.tier_stats():
        if t.name in PIN_TIERS and t.enabled:
            budget[t.name] = {"budget_bytes": int(share * t.capacity_bytes),
                              "pinned_bytes": _below(state).pins.pinned_bytes(t.name)}
    return budget


def _below(state: DaemonState) -> TierManager:
    tiers = state.engine.engine.tiers
    assert tiers is not None, "a pin below the device needs the lower tiers"
    return tiers


@routes.get("/admin/pins")
async def list_pins(request: web.Request) -> web.Response:
    state = request.app[STATE]
    kv = state.engine.engine.kv
    pins = await state.engine.call(lambda: [pin_json(state, p) for p in kv.pins])
    return web.json_response({"pins": pins, **budget_json(state)})


@routes.post("/admin/pins")
async def add_pin(request: web.Request) -> web.Response:
    """Pins `session_id`, or a prefix (text, messages or token_ids in `tenant`'s namespace or "public"),
    for `ttl_s` seconds or until unpinned. A pin over the budget is refused (409)."""
    state = request.app[STATE]
    body = require_object(await read_json(request), PREFIX_FIELDS | {"session_id", "tenant", "ttl_s", "tier"})
    tier = body.get("tier", "device")
    if tier not in ("device", *PIN_TIERS):
        raise bad_request(f"tier must be device, {' or '.join(PIN_TIERS)}", param="tier")
    ttl_s = body.get("ttl_s")
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                              or not 0 < ttl_s <= MAX_TTL_S):
        raise bad_request(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S}]; leave it out to pin until "
                          "unpinned", param="ttl_s")
    pin_id = f"pin_{uuid.uuid4().hex[:16]}"
    if "session_id" in body:
        if PREFIX_FIELDS & set(body):
            raise bad_request("pin either a session_id or a prefix, not both", param="session_id")
        sid = body["session_id"]
        if not isinstance(sid, str):
            raise bad_request("session_id must be a string", param="session_id")
        tenant = await session_tenant(state, sid, tenant_param(body) or None, param="session_id")
        record = PinRecord(pin_id, tenant, "session", sid, (), _utcnow(), _expiry(ttl_s), tier)
    else:
        record = PinRecord(pin_id, tenant_param(body), "prefix", None, tuple(prefix_tokens(state, body)), _utcnow(),
                           _expiry(ttl_s), tier)
    pin = await pin_record(state, record, ttl_s)
    await state.db(state.store.save_pin, record)
    return web.json_response({"pin": pin_json(state, pin), **budget_json(state)}, status=201)


@routes.delete("/admin/pins/{pin_id}")
async def delete_pin(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pin_id = request.match_info["pin_id"]
    pin = await state.engine.call(lambda: state.engine.engine.unpin(pin_id))
    stored = await state.db(state.store.delete_pin, pin_id)
    if pin is None and not stored:
        raise not_found(f"no pin {pin_id!r}", code="pin_not_found")
    return web.json_response({"id": pin_id, "deleted": True, "freed_pages": len(pin.block_ids) if pin else 0})


async def pin_record(state: DaemonState, record: PinRecord, ttl_s: float | None) -> Pin:
    """Pins what `record` names in the engine, computing a prefix that is not cached (PinError if refused)."""
    eng = state.engine.engine
    if record.kind == "session":
        return await state.engine.call(lambda: eng.pin_session(record.id, record.session_id, record.tenant, ttl_s,
                                                               record.tier))
    ids = list(record.token_ids)

    def pin() -> Pin | None:
        return eng.pin_prefix(record.id, ids, record.tenant, ttl_s, record.tier)

    found = await state.engine.call(pin)
    if found is None:
        await Generation(state.engine, ids, SamplingParams(max_tokens=1, temperature=0.0), record.tenant).run()
        found = await state.engine.call(pin)
    if found is None:
        raise ApiError(503, "the prefix was computed but its pages were evicted at once; raise kv_cache_bytes",
                       code="cache_full")
    return found


async def restore_pins(state: DaemonState) -> None:
    """Pins again what the store holds (at startup); a pin that no longer fits is logged and kept stored."""
    now = _utcnow()
    for record in await state.db(state.store.list_pins):
        ttl_s = None if record.expires_at is None else (record.expires_at - now).total_seconds()
        try:
            await pin_record(state, record, ttl_s)
        except (PinError, ApiError) as e:
            log.warning("pin %s not restored: %s", record.id, e)
    log.info("%d pin(s) restored", len(state.engine.engine.kv.pins))


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _expiry(ttl_s: float | None) -> datetime | None:
    return None if ttl_s is None else _utcnow() + timedelta(seconds=ttl_s)
