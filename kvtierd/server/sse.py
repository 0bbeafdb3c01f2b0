"""Server-sent events for streamed completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web

from kvtierd.server.state import DaemonState


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, payload: dict | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode())


async def serve_sse(request: web.Request, state: DaemonState, events: AsyncIterator[dict | str]) -> web.StreamResponse:
    """Sends each event; a client that goes away ends the stream quietly (not a server error)."""
    response = await open_stream(request)
    state.counters.active_streams += 1
    try:
        async for event in events:
            await send(response, event)
    except ConnectionResetError:
        pass
    finally:
        state.counters.active_streams -= 1
        await events.aclose()  # runs the producer's cleanup: cancels generation, records an interrupted turn
    return response
