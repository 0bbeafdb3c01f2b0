"""Admin routes (root or the admin group only): what kvtierctl shows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from aiohttp import web

from kvtierd import __version__
from kvtierd.cache.fragmentation import Fragmentation
from kvtierd.engine.step_cost import StepCost
from kvtierd.server.chunk_catalog import CatalogReconciliation
from kvtierd.server.errors import ApiError
from kvtierd.server.placement import placed_here
from kvtierd.server.session_routes import drop_session_kv, message_json, query_limit, session_json, session_tenant
from kvtierd.server.state import STATE, DaemonState
from kvtierd.storage.owner_shares import OwnerUsage
from kvtierd.tiers.tier_stats import TierStats

routes = web.RouteTableDef()


def engine_status(state: DaemonState) -> dict:
    eng = state.engine.engine
    pool = eng.kv.pool
    return {
        "attention_backend": state.loaded.model.attention.name,
        "matmul_backend": state.loaded.model.matmul_backend,
        "running": len(eng.scheduler.running),
        "waiting": len(eng.scheduler.waiting),
        "loading": len(eng.scheduler.loading),
        "block_size": eng.config.block_size,
        "num_blocks": pool.num_blocks,
        "free_blocks": pool.num_free_blocks,
        "cached_blocks": pool.num_cached_blocks,
        "used_blocks": pool.num_used_blocks,
        "qos": qos_status(eng),
    }


def qos_status(eng) -> dict:
    """Requests per class, the reserved region (size, bounds, resizes), pins and the step cost."""
    pool = eng.kv.pool
    reserve = pool.reserve
    by_class = {c: {"running": 0, "waiting": 0, "rejected": n} for c, n in eng.counters.rejected.items()}
    for r in eng.scheduler.running:
        by_class[r.qos_class]["running"] += 1
    for r in eng.scheduler.waiting:
        by_class[r.qos_class]["waiting"] += 1
    return {
        "classes": by_class,
        "shed": eng.counters.shed,  # low requests refused while a high one waited
        "high_pages": pool.num_high_blocks,
        "reserved": None if reserve is None else {
            "pages": reserve.pages, "floor": reserve.floor, "ceiling": reserve.ceiling,
            "unused_pages": reserve.unused(pool.num_high_blocks), "window_s": reserve.window_s,
            "resizes": [{"old_pages": r.old_pages, "new_pages": r.new_pages, "p99_pages": r.p99_pages}
                        for r in reserve.history[-10:]],
        },
        "pins": len(eng.kv.pins), "pinned_pages": pool.num_pinned_blocks, "pin_budget_pages": eng.kv.pins.budget_pages,
        "step_cost": step_cost_status(eng),
    }


def step_cost_status(eng) -> dict:
    """What a step costs as the engine measures it: the time-bounded steps plan with these."""
    cost = eng.step_cost.current
    status = _coefficients_ms(cost)
    larger = []  # a quantized mode's regimes: the steps past each bound run other kernels
    while cost.large is not None:
        larger.append({**_coefficients_ms(cost.large), "past_tokens": cost.small_step_max_tokens})
        cost = cost.large
    if larger:
        status["larger_steps"] = larger
    return {**status, "steps_observed": eng.step_cost.num_observed}


def _coefficients_ms(cost: StepCost) -> dict:
    return {"overhead_ms": cost.overhead_s * 1e3, "prefill_token_ms": cost.prefill_token_s * 1e3,
            "decode_token_ms": cost.decode_token_s * 1e3, "context_token_ms": cost.context_token_s * 1e3}


@routes.get("/admin/status")
async def status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    lm = state.loaded
    return web.json_response({
        "version": __version__,
        "uptime_s": time.monotonic() - state.started,
        "socket": str(state.settings.socket),
        "state_dir": str(state.settings.state_dir),
        "model": {"name": lm.name, "fingerprint": lm.fingerprint, "architecture": lm.config.architecture,
                  "num_layers": lm.config.num_layers, "device": str(lm.model.device),
                  "dtype": lm.model.mode.name, "kv_dtype": str(lm.model.kv_dtype).removeprefix("torch."),
                  "context_window": state.engine.engine.max_model_len},
        "engine": await state.engine.call(lambda: engine_status(state)),  # between two steps
        "draining": state.draining,
        "instance": state.settings.instance,
        "tenants": list(state.settings.tenants),  # its allow-list; []: every tenant not placed elsewhere
        "placed_here": placed_here(state.settings.instance, state.settings.placement),
    })


@routes.get("/admin/tiers")
async def tiers(request: web.Request) -> web.Response:
    state = request.app[STATE]
    eng = state.engine.engine
    remote = eng.tiers.remote if eng.tiers is not None else None
    remote_usage: dict[bytes, OwnerUsage] = {}
    if remote is not None and remote.has_limits:
        # The tenants' remote ledgers: one Redis round trip, on a worker thread (never in the engine's step).
        roots = await state.engine.call(lambda: list(eng.cache_shares.names))
        remote_usage = await asyncio.to_thread(remote.usage_by_owner, roots)
    # On the engine thread between two steps: the pool's structures are the step's to edit.
    return web.json_response(await state.engine.call(lambda: tiers_json(state, remote_usage)))


def tiers_json(state: DaemonState, remote_usage: dict[bytes, OwnerUsage] | None = None) -> dict:
    eng = state.engine.engine
    pool = eng.kv.pool
    c = eng.counters
    page_bytes = eng.geometry.bytes_per_block
    idle_cached = len(pool.idle_cached_blocks())
    device_hits = c.device_tokens
    return {"tiers": [{
        "name": "device",
        "capacity_bytes": pool.num_blocks * page_bytes,
        "used_bytes": pool.num_used_blocks * page_bytes,
        "pages_total": pool.num_blocks,
        "pages_used": pool.num_used_blocks,
        "pages_cached": idle_cached,
        "pages_retained": pool.num_retained_blocks,  # idle cached pages a retention hint keeps ahead of the rest
        "pages_free": pool.num_free_blocks - idle_cached,
        "query_tokens": c.prompt_tokens,
        "hit_tokens": device_hits,
        "hit_rate": device_hits / c.prompt_tokens if c.prompt_tokens else 0.0,
        "eviction_policy": eng.config.eviction_policy,
        "evictions": asdict(pool.evictions),
        "enabled": True,
        "healthy": True,
    }] + [lower_tier_json(t, c.prompt_tokens, eng.tiers.chunk_pages, state.reconciliation)
          for t in eng.tier_stats()], "cache_shares": eng.cache_shares.enabled,
        "tenants": tenants_json(eng, remote_usage)}


def tenants_json(eng, remote: dict[bytes, OwnerUsage] | None = None) -> list[dict]:
    """Each tenant's cached device pages against its share, its page hits and evictions, its host chunks, and
    its disk chunks and bytes (with its chunks not written at its disk limit; disk values stored before owners
    were recorded are the tenant "(unowned)"), and for a tenant with a remote limit its remote chunks and bytes
    as the fleet's ledger in Redis records them (`remote`; 0 for the others: without a limit none is kept)."""
    remote = remote or {}
    shares = eng.cache_shares
    host = eng.tiers.host.slots_by_owner() if eng.tiers is not None and eng.tiers.host is not None else {}
    disk = eng.tiers.disk.usage_by_owner() if eng.tiers is not None and eng.tiers.disk is not None else {}
    no_disk = OwnerUsage(0, 0, 0)
    rows = []
    for root in {*shares.cached, *shares.counts, *host, *disk, *remote}:
        counts = shares.counts_of(root) if root in shares.counts else None
        on_disk, on_remote = disk.get(root, no_disk), remote.get(root, no_disk)
        rows.append({
            "tenant": shares.names.get(root, root.hex()[:16] or "(unowned)"), "weight": shares.weight(root),
            "device_pages": shares.cached[root], "share_pages": round(shares.share_pages(root), 1),
            "hits": counts.hits if counts else 0, "evictions": counts.evictions if counts else 0,
            "evictions_under_share": counts.evictions_under_share if counts else 0,
            "host_chunks": host.get(root, 0),
            "disk_chunks": on_disk.entries, "disk_bytes": on_disk.nbytes, "disk_over_limit": on_disk.over_limit,
            "remote_chunks": on_remote.entries, "remote_bytes": on_remote.nbytes,
            "remote_over_limit": on_remote.over_limit,
        })
    return sorted(rows, key=lambda r: (-r["device_pages"], r["tenant"]))


def lower_tier_json(t: TierStats, query_tokens: int, chunk_pages: int,
                    reconciliation: CatalogReconciliation | None = None) -> dict:
    """A host or disk tier: entries are chunks of up to chunk_pages pages; hits are chunks loaded back. The
    disk's `reconciled`: the orphans its startup reconciliation with the SQL chunk catalog removed."""
    reconciled = asdict(reconciliation) if t.name == "disk" and reconciliation is not None else None
    return {
        "name": t.name, "enabled": t.enabled, "healthy": t.healthy, "reason": t.reason,
        "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "entries": t.entries,
        "chunk_pages": chunk_pages, "query_tokens": query_tokens, "hits": t.hits, "hit_tokens": t.hit_tokens,
        "hit_rate": t.hit_tokens / query_tokens if query_tokens else 0.0,
        "writes": t.writes, "pending_writes": t.pending_writes, "dropped_writes": t.dropped_writes,
        "evictions": {"capacity": t.evictions}, "corrupt": t.corrupt, "pinned": t.pinned, "codec": t.codec,
        "reconciled": reconciled, "known_chunks": t.known_chunks,
    }


@routes.get("/admin/stats")
async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    c = state.engine.engine.counters
    return web.json_response({
        "requests": c.requests, "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
        "generated_tokens": c.generated_tokens, "preemptions": c.preemptions, "aborted": c.aborted,
        "errors_4xx": state.counters.errors_4xx, "errors_5xx": state.counters.errors_5xx,
        "active_streams": state.counters.active_streams,
    })


@routes.post("/admin/compact")
async def compact(request: web.Request) -> web.Response:
    """Moves the live KV pages together between two steps (cache/compaction.py)."""
    state = request.app[STATE]
    eng = state.engine.engine
    result = await state.engine.call(eng.compact)
    return web.json_response({
        "pages_moved": result.pages_moved, "bytes_moved": result.pages_moved * eng.geometry.bytes_per_block,
        "ms": result.seconds * 1e3, "before": fragmentation_json(result.before),
        "after": fragmentation_json(result.after),
    })


def fragmentation_json(f: Fragmentation) -> dict:
    return {"free_space_ratio": f.free_space, "sequence_ratio": f.sequence, **asdict(f)}


@routes.get("/admin/sessions")
async def admin_sessions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tenant = request.query.get("tenant")
    limit = query_limit(request)
    if tenant:
        sessions = await state.db(state.store.list_sessions, tenant, limit)
    else:
        sessions = await state.db(state.store.list_all_sessions, limit)
    counts = await state.db(state.store.count_messages, [(s.tenant, s.id) for s in sessions])
    return web.json_response({"sessions": [session_json(s, counts[(s.tenant, s.id)]) for s in sessions]})


async def _any_session(request: web.Request):
    state = request.app[STATE]
    sid = request.match_info["session_id"]
    tenant = await session_tenant(state, sid, request.query.get("tenant"))
    session = await state.db(state.store.get_session, tenant, sid)
    if session is None:
        raise ApiError(404, f"no session {sid!r}", code="session_not_found")
    return session


@routes.get("/admin/sessions/{session_id}")
async def admin_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session = await _any_session(request)
    messages = await state.db(state.store.messages, session.tenant, session.id)
    eng = state.engine.engine
    view = await state.engine.call(lambda: eng.session_view(session.id, session.tenant))
    kv = None if view is None else {
        "num_tokens": view.num_tokens, "idle_s": view.idle_s,
        "resident_tokens": sum(p.num_tokens for p in view.pages if p.resident),
        "pages": [{"page": p.block_id, "num_tokens": p.num_tokens, "tier": "device" if p.resident else None,
                   "indexed": p.indexed} for p in view.pages],
    }
    return web.json_response({"session": session_json(session, len(messages)),
                              "messages": [message_json(m) for m in messages], "kv": kv})


@routes.delete("/admin/sessions/{session_id}")
async def admin_delete_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    session = await _any_session(request)
    freed = await drop_session_kv(request, session)
    deleted = await state.db(state.store.delete_session, session.tenant, session.id)
    return web.json_response({"deleted": deleted, "freed_blocks": freed})
