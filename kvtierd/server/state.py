"""What every handler shares: the settings, the model, the engine, the store, counters and metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from aiohttp import web

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.server.chunk_catalog import CatalogReconciliation
from kvtierd.model.loader import LoadedModel
from kvtierd.server.metrics import ServerMetrics
from kvtierd.server.settings import Settings
from kvtierd.server.tenant_limits import InFlight
from kvtierd.server.workload import WorkloadRecorder
from kvtierd.storage.session_store import SessionStore

T = TypeVar("T")


@dataclass(slots=True)
class ServerCounters:
    errors_4xx: int = 0
    errors_5xx: int = 0
    active_streams: int = 0


@dataclass(slots=True)
class DaemonState:
    settings: Settings
    loaded: LoadedModel
    engine: AsyncEngine
    store: SessionStore
    started: float = field(default_factory=time.monotonic)
    draining: bool = False
    in_flight: int = 0
    counters: ServerCounters = field(default_factory=ServerCounters)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    workload: WorkloadRecorder = field(default_factory=WorkloadRecorder)  # replaced by the snapshot at startup
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # (tenant, session id) -> messages its prompt leaves out since it outgrew the window
    truncation_cuts: dict[tuple[str, str], int] = field(default_factory=dict)
    reconciliation: CatalogReconciliation | None = None  # the disk tier against the chunk catalog, at startup
    tenant_inflight: InFlight = field(default_factory=InFlight)  # requests per tenant, for [qos] tenant_limits

    @property
    def chunk_store(self) -> str | None:
        """The disk tier's name in the SQL chunk catalog; None: no catalog (no disk tier)."""
        tiers = self.engine.engine.tiers
        return tiers.store_name if tiers is not None and tiers.has_disk else None

    @property
    def model_id(self) -> str:
        return self.loaded.name

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs a (blocking) session-store call on a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)


STATE = web.AppKey("state", DaemonState)
