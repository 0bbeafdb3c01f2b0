"""The aiohttp application: routes, middleware, and the engine's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from kvtierd.server import (admin_routes, chat_routes, metrics_routes, openapi, pin_routes, prefix_routes,
                            session_routes, workload_routes)
from kvtierd.server.chunk_catalog import reconcile_disk_tier, warm_recent_sessions
from kvtierd.server.metrics_routes import metrics_middleware
from kvtierd.server.middleware import errors_middleware, peer_middleware
from kvtierd.server.state import STATE, DaemonState

health_routes = web.RouteTableDef()


@health_routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    snap = state.engine.engine.snapshot  # taken between steps: never the scheduler's lists while a step edits them
    return web.json_response({"status": "ok", "model": state.model_id, "running": snap.running,
                              "waiting": snap.waiting, "loading": snap.loading})


ROUTE_TABLES = (chat_routes.routes, session_routes.routes, admin_routes.routes, prefix_routes.routes, pin_routes.routes,
                workload_routes.routes, openapi.routes, health_routes, metrics_routes.routes)


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.engine.start()
    state.reconciliation = await reconcile_disk_tier(state)  # before the pins, which may hold disk chunks
    await pin_routes.restore_pins(state)
    await warm_recent_sessions(state)
    yield
    await state.engine.stop()
    await asyncio.to_thread(state.engine.engine.close)  # commits queued disk-tier writes
    state.store.close()


def make_app(state: DaemonState) -> web.Application:
    app = web.Application(client_max_size=state.settings.max_body_bytes,
                          middlewares=[metrics_middleware, errors_middleware, peer_middleware])
    app[STATE] = state
    for table in ROUTE_TABLES:
        app.add_routes(table)
    app.cleanup_ctx.append(_engine_lifetime)
    app.cleanup_ctx.append(workload_routes.workload_lifetime)
    if state.settings.instance:
        app.on_response_prepare.append(_name_instance)
    return app


async def _name_instance(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says which instance gave it (placement: one daemon per GPU behind one front)."""
    response.headers["X-Kvtierd-Instance"] = request.app[STATE].settings.instance
