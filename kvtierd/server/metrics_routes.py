"""GET /metrics (Prometheus text format), and the middleware that counts every response.

/metrics answers anyone who can connect to the socket, like /healthz: it shows
counts and timings, never prompts, tenants or session ids.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvtierd.server.engine_metrics import EngineCollector
from kvtierd.server.state import STATE

routes = web.RouteTableDef()


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    uptime_s = time.monotonic() - state.started
    engine = await state.engine.call(
        lambda: EngineCollector(state.engine.engine, state.counters, uptime_s, state.reconciliation))
    return web.Response(body=state.metrics.render(engine), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Outermost: it sees the response the errors middleware made of any exception."""
    response = await handler(request)
    resource = request.match_info.route.resource
    # The route's pattern, never the path: a label per session id would grow without bound.
    route = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.observe_response(route, response.status)
    return response
