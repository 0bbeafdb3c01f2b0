"""`kvtierd serve`: load the model, open the store, bind the socket, serve, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

import torch
from aiohttp import web

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.model.loader import load_model
from kvtierd.server.app import make_app
from kvtierd.server.settings import Settings
from kvtierd.server.state import DaemonState
from kvtierd.server.unix_socket import bind_unix_socket, check_socket_path
from kvtierd.storage.session_store import SessionStore

log = logging.getLogger("kvtierd")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_state(settings: Settings) -> DaemonState:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(settings.model, resolve_device(settings.device))
    engine = LLMEngine(loaded, EngineConfig(
        block_size=settings.block_size, kv_cache_bytes=settings.kv_cache_bytes,
        max_num_batched_tokens=settings.max_num_batched_tokens, max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len or None,
        eviction_policy=settings.eviction_policy, prefix_ttl_s=settings.prefix_ttl_s,
        prefix_min_hits_per_hour=settings.prefix_min_hits_per_hour, session_idle_ttl_s=settings.session_idle_ttl_s,
        hash_algorithm=settings.hash_algorithm,
    ))
    log.info("model %s loaded (%s, %d layers, fingerprint %s); KV pool %d pages of %d tokens",
             loaded.name, loaded.model.device, loaded.config.num_layers, loaded.fingerprint,
             engine.kv.pool.num_blocks, settings.block_size)
    return DaemonState(settings=settings, loaded=loaded, engine=AsyncEngine(engine), store=SessionStore(settings.store_url))


async def serve(settings: Settings) -> None:
    check_socket_path(settings.socket)  # a path we cannot serve on fails in a second, not after loading the model
    state = build_state(settings)
    sock = bind_unix_socket(settings.socket, settings.socket_mode, settings.socket_group)
    # handler_cancellation: a client that hangs up cancels its request, so its generation stops and frees its pages.
    runner = web.AppRunner(make_app(state), handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    log.info("serving on %s", settings.socket)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    # Drain: new requests get 503 from here on; in-flight ones may finish.
    state.draining = True
    log.info("draining: %d request(s) in flight, up to %.0f s", state.in_flight, settings.drain_timeout_s)
    if state.in_flight:
        try:
            await asyncio.wait_for(state.idle.wait(), settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timeout: %d request(s) cut off", state.in_flight)
    await runner.cleanup()
    settings.socket.unlink(missing_ok=True)
    log.info("stopped")
