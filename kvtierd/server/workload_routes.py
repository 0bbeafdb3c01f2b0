"""GET /admin/workload: the recorded workload and the cache configuration, for `kvtierctl advise`.

The recorder (`server/workload.py`) is loaded from `<state_dir>/workload.json`
when the app starts, saved there every SNAPSHOT_PERIOD_S and at shutdown, so the
advice draws on every run of the daemon (a kill -9 loses at most one period).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from kvtierd.server.state import STATE, DaemonState
from kvtierd.server.workload import load_recorder, write_snapshot
from kvtierd.server.workload_report import CacheFacts, WorkloadReport

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

SNAPSHOT_FILE = "workload.json"
SNAPSHOT_PERIOD_S = 300.0


def cache_facts(state: DaemonState) -> CacheFacts:
    eng, s = state.engine.engine, state.settings
    reserve = eng.kv.pool.reserve
    return CacheFacts(
        block_size=eng.config.block_size, device_pages=eng.kv.pool.num_blocks,
        bytes_per_page=eng.geometry.bytes_per_block, kv_cache_bytes=s.kv_cache_bytes, host_bytes=s.host_bytes,
        disk_bytes=s.disk_bytes, context_window=eng.max_model_len, reserved_share=s.reserved_share,
        reserved_min_share=s.reserved_min_share, reserved_max_share=s.reserved_max_share,
        reserved_pages=None if reserve is None else reserve.pages,
        reserved_floor=None if reserve is None else reserve.floor,
        reserved_ceiling=None if reserve is None else reserve.ceiling,
    )


@routes.get("/admin/workload")
async def workload(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = state.workload.stats(state.engine.engine.config.block_size)
    return web.json_response(WorkloadReport(stats, cache_facts(state)).to_json())


async def save_workload(state: DaemonState) -> None:
    """Writes the snapshot off the event loop; a failure is logged, never raised (it is only statistics)."""
    path = state.settings.state_dir / SNAPSHOT_FILE
    try:
        await asyncio.to_thread(write_snapshot, path, state.workload.to_json())
    except OSError as e:
        log.warning("workload snapshot not saved to %s: %s", path, e)


async def workload_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.workload = await asyncio.to_thread(load_recorder, state.settings.state_dir / SNAPSHOT_FILE)
    stopping = asyncio.Event()

    async def save_periodically() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), SNAPSHOT_PERIOD_S)
            last = stopping.is_set()  # the shutdown's save: its snapshot is taken after every request ended
            await save_workload(state)
            if last:
                return

    saver = asyncio.create_task(save_periodically())
    yield
    stopping.set()
    await saver  # not cancelled: a save in flight finishes before the last one starts
