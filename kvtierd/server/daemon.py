"""`kvtierd serve`: load the model, open the store, bind the socket, serve, drain on SIGTERM.

Under systemd (Type=notify, sd_notify.py) it says how it is doing: EXTEND_TIMEOUT_USEC
while the model loads, READY=1 once the socket serves, STATUS= lines and WATCHDOG=1
pings while the engine answers, STOPPING=1 when the drain starts, EXTEND_TIMEOUT_USEC
again while the KV tiers flush. Socket-activated
(socket_activation.py), it serves on the socket systemd passed instead of binding one.
Outside systemd all of this is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from aiohttp import web

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.config import EngineConfig, QosConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.kernels.thread_pinning import pin_compute_threads
from kvtierd.kernels.torch_threads import step_executor
from kvtierd.model.loader import load_model
from kvtierd.server.app import make_app
from kvtierd.server.sd_notify import notify, watchdog_period
from kvtierd.server.settings import Settings, SettingsError
from kvtierd.server.socket_activation import take_listen_socket
from kvtierd.server.state import DaemonState
from kvtierd.server.unix_socket import bind_unix_socket, check_socket_path
from kvtierd.storage.redis_client import parse_redis_url
from kvtierd.storage.session_store import SessionStore
from kvtierd.storage.store_errors import StoreArgumentError
from kvtierd.tiers.config import RemoteConfig, TierConfig

log = logging.getLogger("kvtierd")

EXTENSION_S = 30.0  # what each EXTEND_TIMEOUT_USEC buys during a long step; sent three times as often
STATUS_PERIOD_S = 10.0  # how often STATUS= is refreshed when no watchdog asks for more
STOP_MARGIN_S = 15.0  # shutdown time past the drain: closing the engine and the store


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_state(settings: Settings, executor: ThreadPoolExecutor) -> DaemonState:
    """Loads the model and builds the engine; called on `executor`, the thread the engine then computes on."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(settings.device)
    # before the model's load, this thread's first torch op
    pinning = pin_compute_threads() if device == "cpu" and settings.pin_compute_threads else None
    loaded = load_model(settings.model, device, dtype=settings.dtype,
                        cache_dir=settings.model_cache_dir, kv_dtype=settings.kv_dtype)
    engine = LLMEngine(loaded, EngineConfig(
        block_size=settings.block_size, kv_cache_bytes=settings.kv_cache_bytes,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
        prefill_share=settings.prefill_share, prefill_chunk_beside_decodes=settings.prefill_chunk_beside_decodes,
        max_model_len=settings.max_model_len or None,
        eviction_policy=settings.eviction_policy, prefix_ttl_s=settings.prefix_ttl_s,
        prefix_min_hits_per_hour=settings.prefix_min_hits_per_hour, session_idle_ttl_s=settings.session_idle_ttl_s,
        hash_algorithm=settings.hash_algorithm, tiers=tier_config(settings), qos=qos_config(settings),
        compact_threshold=settings.compact_threshold,
    ))
    log.info("model %s loaded (%s, %s weights, %s KV, %d layers, fingerprint %s); KV pool %d pages of %d tokens",
             loaded.name, loaded.model.device, loaded.model.mode.name, str(loaded.model.kv_dtype).removeprefix("torch."),
             loaded.config.num_layers, loaded.fingerprint,
             engine.kv.pool.num_blocks, settings.block_size)
    if pinning is not None:
        log.info("compute threads %s", pinning)
    for tier in engine.tier_stats():
        log.info("%s KV tier: %s", tier.name, f"{tier.capacity_bytes} bytes" if tier.enabled else tier.reason)
    return DaemonState(settings=settings, loaded=loaded, engine=AsyncEngine(engine, executor), store=SessionStore(settings.store_url))


def qos_config(settings: Settings) -> QosConfig:
    return QosConfig(weights=settings.qos_weights, max_queue_s=settings.qos_max_queue_s, aging_s=settings.qos_aging_s,
                     shed_low_after_s=settings.shed_low_after_s, step_budget_ms=settings.step_budget_ms,
                     step_budget_hold_s=settings.step_budget_hold_s,
                     reserved_share=settings.reserved_share, reserved_min_share=settings.reserved_min_share,
                     reserved_max_share=settings.reserved_max_share, reserved_window_s=settings.reserved_window_s,
                     pin_share=settings.pin_share, cache_shares=settings.cache_shares,
                     tenant_cache_weights=settings.tenant_cache_weights,
                     tenant_host_bytes={t: lim.host for t, lim in settings.tenant_limits.items() if lim.host},
                     tenant_disk_bytes={t: lim.disk for t, lim in settings.tenant_limits.items() if lim.disk},
                     tenant_remote_bytes={t: lim.remote for t, lim in settings.tenant_limits.items() if lim.remote})


def tier_config(settings: Settings) -> TierConfig | None:
    """The host and disk tiers, and the fleet's remote tier; the disk store lives in <state_dir>/kv (a
    directory we make, or it is off)."""
    remote = remote_config(settings)
    if not (settings.host_bytes or settings.disk_bytes or remote):
        return None
    disk_path: Path | None = settings.state_dir / "kv"
    try:
        if settings.disk_bytes:
            disk_path.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        log.warning("serving without the disk KV tier: cannot make %s: %s", disk_path, e.strerror)
        disk_path = None
    return TierConfig(host_bytes=settings.host_bytes, disk_bytes=settings.disk_bytes, disk_path=disk_path,
                      chunk_pages=settings.chunk_pages, disk_codec=settings.disk_codec,
                      disk_admission=settings.disk_admission, store_defer_ms=settings.store_defer_ms,
                      lookup_wait_share=settings.lookup_wait_share, remote=remote)


def remote_config(settings: Settings) -> RemoteConfig | None:
    """The fleet's Redis, with its secret read from `remote_secret_file` (never from the environment:
    a secret there leaks into /proc and child processes)."""
    if not settings.remote_url:
        return None
    if not settings.remote_secret_file:
        raise SettingsError("remote_url needs remote_secret_file: the fleet's secret seals every remote value")
    try:
        secret = Path(settings.remote_secret_file).read_bytes().strip()
    except OSError as e:
        raise SettingsError(f"cannot read remote_secret_file {settings.remote_secret_file}: {e.strerror}") from e
    if any(limits.remote for limits in settings.tenant_limits.values()):
        try:
            cluster = parse_redis_url(settings.remote_url).topology == "cluster"
        except StoreArgumentError as e:
            raise SettingsError(f"remote_url: {e}") from e
        if cluster:  # RedisStore.limit_by would refuse it later, with a traceback
            raise SettingsError("tenant_limits remote needs one Redis master (a single server or Sentinel): "
                                "a Cluster spreads a tenant's values over slots that one script cannot reach")
    return RemoteConfig(url=settings.remote_url, secret=secret, fleet=settings.remote_fleet,
                        ttl_s=settings.remote_ttl_s, op_timeout_ms=settings.remote_op_timeout_ms,
                        codec=settings.disk_codec, admission=settings.remote_admission,
                        directory=settings.remote_directory)


async def flush_tiers(state: DaemonState) -> None:
    """Writes the KV worth a restart (sessions, prefixes hit at least once) to the disk tier: copied out
    between two steps, committed off the event loop."""
    eng = state.engine.engine
    if eng.tiers is None or not eng.tiers.has_disk:
        return
    # Bounded batches: each call copies what the writer's queue has room for, from the pages as they are then.
    while True:
        done = await state.engine.call(eng.flush_tiers)
        await asyncio.to_thread(eng.tiers.wait)
        if done:
            break
    log.info("KV of sessions and reused prefixes flushed to the disk tier")


def _usec(seconds: float) -> int:
    return int(seconds * 1_000_000)


@contextlib.asynccontextmanager
async def _extending_timeout(status: str) -> AsyncIterator[None]:
    """Keeps systemd's start or stop timeout from running out while a long step runs (loading a big
    model, flushing the KV tiers): TimeoutStartSec=/TimeoutStopSec= stay short for everything else."""

    async def extend() -> None:
        while True:
            notify(f"EXTEND_TIMEOUT_USEC={_usec(EXTENSION_S)}", f"STATUS={status}")
            await asyncio.sleep(EXTENSION_S / 3)

    extender = asyncio.create_task(extend())
    try:
        yield
    finally:
        extender.cancel()


def _status_line(state: DaemonState) -> str:
    eng = state.engine.engine
    return (f"STATUS={'draining' if state.draining else 'serving'}; {len(eng.scheduler.running)} running, "
            f"{len(eng.scheduler.waiting)} waiting, {eng.kv.pool.num_used_blocks}/{eng.kv.pool.num_blocks} pages used")


async def heartbeat(engine: AsyncEngine, status: Callable[[], str]) -> None:
    """Sends `status()` (a STATUS= line) and, when systemd watches us, WATCHDOG=1: each time only
    after the engine ran `status` between two steps. A hung step (or a blocked event loop) stops
    the pings, and systemd restarts the daemon once WatchdogSec= passes without one."""
    period = watchdog_period()
    watchdog = ["WATCHDOG=1"] if period else []
    period = period or STATUS_PERIOD_S
    probe: asyncio.Future[str] | None = None
    while True:
        if probe is None:
            probe = asyncio.ensure_future(engine.call(status))
        await asyncio.wait([probe], timeout=period)  # a timeout leaves the probe waiting for its step to end
        if probe.done():
            notify(probe.result(), *watchdog)
            probe = None
            await asyncio.sleep(period)


def freeze_startup_heap() -> None:
    """Moves every object alive once the daemon is up (torch, the model, the tokenizer: ~270k of them) out of
    the garbage collector's reach: they live as long as the daemon. A full collection walks every tracked object
    with the GIL held, ~180 ms of it on 2 cores, and each one froze every stream that long (`bench stall`: a
    step's scheduling took 160-210 ms during one load in three). Frozen, it walks only what requests made since."""
    gc.collect()  # what is garbage already is not frozen
    gc.freeze()


async def serve(settings: Settings) -> None:
    activated = take_listen_socket()
    if activated is None:
        check_socket_path(settings.socket)  # a path we cannot serve on fails in a second, not after loading the model
    async with _extending_timeout("loading the model"):
        # off the loop, so the extensions keep going; on the step thread, the one thread torch computes on
        executor = step_executor()
        state = await asyncio.get_running_loop().run_in_executor(executor, build_state, settings, executor)
    sock = activated or bind_unix_socket(settings.socket, settings.socket_mode, settings.socket_group)
    # handler_cancellation: a client that hangs up cancels its request, so its generation stops and frees its pages.
    runner = web.AppRunner(make_app(state), handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    freeze_startup_heap()  # before the socket accepts: no request's objects are frozen with it
    await web.SockSite(runner, sock).start()
    if activated is None:
        log.info("serving on %s", settings.socket)
    else:
        log.info("serving on %s (socket activation)", activated.getsockname())
    notify("READY=1", _status_line(state))
    pinger = asyncio.create_task(heartbeat(state.engine, lambda: _status_line(state)))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    # Drain: new requests get 503 from here on; in-flight ones may finish.
    state.draining = True
    log.info("draining: %d request(s) in flight, up to %.0f s", state.in_flight, settings.drain_timeout_s)
    # The extension lets a drain_timeout_s longer than TimeoutStopSec= run its course.
    notify("STOPPING=1", f"EXTEND_TIMEOUT_USEC={_usec(settings.drain_timeout_s + STOP_MARGIN_S)}",
           f"STATUS=draining; {state.in_flight} request(s) in flight")
    if state.in_flight:
        try:
            await asyncio.wait_for(state.idle.wait(), settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timeout: %d request(s) cut off", state.in_flight)
    if settings.flush_on_shutdown:
        async with _extending_timeout("flushing KV to the disk tier"):
            await flush_tiers(state)
    pinger.cancel()
    await runner.cleanup()
    if activated is None:  # an activated socket's file belongs to systemd, which listens on it still
        settings.socket.unlink(missing_ok=True)
    log.info("stopped")
