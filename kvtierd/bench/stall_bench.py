"""`kvtierd bench stall`: do transfers below the device stall the requests that are running?

Real `kvtierd serve` processes on Unix sockets, a real redis-server on loopback
started by the bench, real streamed clients over the socket. First a writer
daemon computes each long prompt (random token ids) twice: the fleet gets
their chunks (remote admission all) and, at its SIGTERM, the disk too (a
prefix hit once is flushed). Then, per scenario, a fresh daemon whose device
and host tier hold nothing of them:

    disk            the writer's state directory again, the remote tier off; data.mdb's pages dropped from
                    the OS page cache (POSIX_FADV_DONTNEED) before it starts and before the quiet spell
                    ahead of each load (the drop is the bench's own kernel work beside the streams: right
                    before a load, it slowed the step its window began in)
    remote          a new state directory, disk off: the prompts' KV is in Redis only
    remote slow     the same through a TCP proxy (a process of its own: bench/slow_proxy.py) that holds each
                    Redis call `redis_delay_ms`
    remote stopped  the same, redis-server stopped right after the warm-up load (the last scenario)

In each, `streams` chat streams decode back to back; after `head_start_s`
one more stored prompt is loaded, unmeasured (a warm-up: the daemon's first
load pays one-time costs), and after a quiet spell a long prompt is sent
(the load); once it answered, the same prompt again
(its pages are on the device now: the device hit), then a fresh prompt of
the same length (nothing cached: the recompute); then, after a quiet spell,
the next of `load_repeats` long prompts the same way. The streams'
inter-token gaps (ITL) are taken in each load window (from sending the long
prompt to its first token), in the window of the same length right before
it, and in each device hit's and recompute's window, and pooled over the
loads; the TTFTs are medians:

    streams   ─┬─ tok ─ tok ─ tok ─ tok ─ tok ─ tok ─ tok ─ tok ─ tok ─ tok ─┬─ ...
               |<---- without load (same length) --->|<--- load window ---->|
    long prompt                                      send              first token

The device hit tells the transfer's own part from the rest: it admits the
same long context with nothing to transfer, so what the load window costs the
streams beyond it is the load's. The recompute's window is what a load that
falls back to recomputing (a slow or stopped Redis) cannot do better than.

With `prefill_share` set, a prompt computed beside the streams (a recompute,
a fresh prompt, a restored prompt's rest) goes in pieces within that share of
their step, which shows what smooth streams cost the long prompts' TTFT.
With `stream_priority` high, the streams outrank the long prompts (normal):
the daemon's step budget (`[qos] step_budget_ms`) then cuts the long
prompts' work around the streams' steps, which shows what that trade costs
the long prompts' TTFT.

A gap belongs to the window its second token arrived in. The bench's own
garbage collections wait for the spells between loads (a full one of the
client's objects took 56-232 ms of one of the two cores). Then, on the writer
daemon (disk and remote on), the stores: a chat session's next turn sent right
after a long first turn, while that turn's KV is written below behind it,
beside another session's next turn sent `turn_later_s` later; before each
first turn, the daemon's pending writes (the long prompts') are let finish.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import shutil
import socket as socketlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis

from kvtierd.bench.qos_bench import VOCAB_SPAN
from kvtierd.bench.report import machine
from kvtierd.bench.reuse_bench import document, follow_up, questions
from kvtierd.bench.serve_bench import (ServeBenchError, async_client, percentile, sse_chunks, started_daemon,
                                       story_prompts)
from kvtierd.engine.config import QOS_CLASSES
from kvtierd.model.bundled import bundled_gguf_path
from kvtierd.model.tokenizer import ChatTokenizer

SCENARIOS = ("disk", "remote", "remote slow", "remote stopped")
TARGET_ITL_P99_X = 1.25  # running streams' ITL p99 during a load, at most this times their p99 without it
TARGET_NEXT_TURN_X = 1.2  # a next turn sent right after a long turn, at most this times one sent later
REDIS_START_S = 30.0  # a hang guard
DRAIN_S = 300.0  # a hang guard
SETTLE_S = 0.2  # after a recompute, the streams' steps are their own again within this
# The quiet spell before a load, in the longest load so far: the next load's window without it fits unless that load
# is half again longer (a spell of 1.2 times the load before cut a 1,034 ms load's window without it to 1,000 ms).
QUIET_SPELL_X = 1.5


@dataclass(frozen=True, slots=True)
class StallWorkload:
    prompt_tokens: int = 2560
    streams: int = 3
    stream_reply_tokens: int = 256  # each stream sends requests of this many tokens back to back
    head_start_s: float = 6.0  # the streams run this long before the load (the window without it fits in it)
    redis_delay_ms: float = 300.0
    kv_cache: str = "512MiB"
    scenarios: tuple[str, ...] = SCENARIOS
    turn_tokens: int = 1450  # the stores: the long first turn's document
    turn_later_s: float = 6.0
    turn_repeats: int = 2
    # Long prompts stored, each loaded once per scenario (TTFTs: median; gaps: pooled). A p99 needs many gaps:
    # with 3, each scenario's came from about a hundred, and one slow step moved it.
    load_repeats: int = 8
    # The streams' QoS class ("high": the daemon's step budget cuts the long prompts' work, which stay normal,
    # around the streams' steps); None: the daemon's default class, the long prompts' own.
    stream_priority: str | None = None
    # The daemons' `[engine] prefill_share`: while the streams decode, a prompt's prefill adds at most this share
    # to their step (0: the daemon's default, off).
    prefill_share: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class Streams:
    """Arrival times of the streams' text chunks, per request (gaps are within one request)."""

    arrivals: list[list[float]] = field(default_factory=list)
    errors: int = 0

    def gaps_ms(self, start: float, end: float) -> list[float]:
        return [(b - a) * 1e3 for times in self.arrivals for a, b in zip(times, times[1:]) if start <= b < end]


# -- the daemons' settings ------------------------------------------------------------------------------


def _env(w: StallWorkload, *, host: bool = False, disk: bool, remote_url: str = "", secret: Path | None = None,
         admission: str = "sessions") -> dict[str, str]:
    env = {"KVTIERD_KV_CACHE_BYTES": w.kv_cache, "KVTIERD_LOG_LEVEL": "warning",
           "KVTIERD_HOST_BYTES": "2GiB" if host else "0", "KVTIERD_DISK_BYTES": "16GiB" if disk else "0",
           "KVTIERD_WARM_SESSIONS": "0", "KVTIERD_REMOTE_URL": remote_url, "KVTIERD_REMOTE_FLEET": "bench-stall",
           "KVTIERD_REMOTE_ADMISSION": admission, "KVTIERD_QOS_MAX_QUEUE_S": "high=0,normal=0,low=0"}
    if w.prefill_share:
        env["KVTIERD_PREFILL_SHARE"] = str(w.prefill_share)
    if secret is not None:
        env["KVTIERD_REMOTE_SECRET_FILE"] = str(secret)
    return env


# -- Redis: a server, and a proxy that makes it slow ----------------------------------------------------


def _free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(directory: Path) -> Iterator[subprocess.Popen]:
    """A redis-server without persistence on a free loopback port (`.port` on the process)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServeBenchError("bench stall needs redis-server (apt-get install redis-server)")
    port = _free_port()
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                                "no", "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process.port = port  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + REDIS_START_S
        with redis.Redis(port=port, socket_timeout=1) as probe:
            while True:
                try:
                    probe.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise ServeBenchError("redis-server did not start") from None
                    time.sleep(0.02)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(10)


# -- clients ----------------------------------------------------------------------------------------------


async def _completion(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, dict]:
    """One streamed completion of one token: TTFT (s) and the daemon's report (cached tokens by tier, restore)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, info = None, {}
    t0 = time.perf_counter()
    async for chunk in sse_chunks(client, "/v1/completions", body):
        if first is None and any(c.get("text") for c in chunk.get("choices", [])):
            first = time.perf_counter()
        info = chunk.get("kvtierd") or info
    if first is None:
        raise ServeBenchError("a completion carried no text")
    return first - t0, info


async def _chat(client: httpx.AsyncClient, messages: list[dict], max_tokens: int, session_id: str | None = None,
                arrivals: list[float] | None = None, priority: str | None = None) -> tuple[float, str]:
    """One streamed chat completion: TTFT (s) and the reply; each text chunk's arrival goes to `arrivals`."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if session_id is not None:
        body["session_id"] = session_id
    if priority is not None:
        body["priority"] = priority
    arrivals = [] if arrivals is None else arrivals
    text = []
    t0 = time.perf_counter()
    async for chunk in sse_chunks(client, "/v1/chat/completions", body):
        for choice in chunk.get("choices", []):
            if content := choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
                text.append(content)
    if not arrivals:
        raise ServeBenchError("a chat reply carried no text")
    return arrivals[0] - t0, "".join(text)


async def _stream_loop(socket: Path, prompts: list[str], reply_tokens: int, priority: str | None,
                       log: Streams) -> None:
    async with async_client(socket) as client:
        for prompt in prompts:
            times: list[float] = []
            log.arrivals.append(times)
            try:
                await _chat(client, [{"role": "user", "content": prompt}], reply_tokens, arrivals=times,
                            priority=priority)
            except (ServeBenchError, httpx.HTTPError):
                log.errors += 1


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_SPAN) for _ in range(n)]


# -- one scenario -----------------------------------------------------------------------------------------


async def _measure(socket: Path, w: StallWorkload, name: str, warm: list[int], prompts: list[list[int]],
                   fresh: list[list[int]], before_load=None, between_loads=None) -> dict:
    """A stored prompt loaded beside the streams once, unmeasured (the daemon's first load pays its one-time
    costs, as its first request does); then each of the others in turn, each followed by a fresh prompt of its
    length (the recompute), then a quiet spell QUIET_SPELL_X times the longest load so far, so the next load's
    window without it (as long as that load's window) holds only the streams' own steps. `between_loads` runs
    before each quiet spell: what it costs the machine (the page cache dropped) lands in neither window, and
    so do the bench's own garbage collections, held meanwhile: a full one of its objects took 56-232 ms of a
    core beside the daemon's steps, a gap of that length in whichever window it fell in."""
    gc.collect()
    gc.disable()
    try:
        return await _measure_loads(socket, w, name, warm, prompts, fresh, before_load, between_loads)
    finally:
        gc.enable()


async def _measure_loads(socket: Path, w: StallWorkload, name: str, warm: list[int], prompts: list[list[int]],
                         fresh: list[list[int]], before_load, between_loads) -> dict:
    async with async_client(socket) as client:
        await _chat(client, [{"role": "user", "content": "Say hello."}], 2)  # warm-up, not measured
        log = Streams()
        stories = story_prompts(64 * w.streams, w.seed)
        tasks = [asyncio.create_task(_stream_loop(socket, stories[i::w.streams], w.stream_reply_tokens,
                                                       w.stream_priority, log))
                 for i in range(w.streams)]
        await asyncio.sleep(w.head_start_s)
        ttft_warm, _ = await _completion(client, warm)
        for before in (before_load, between_loads):
            if before is not None:
                await asyncio.to_thread(before)
        longest = ttft_warm
        quiet_since = time.perf_counter() + SETTLE_S
        await asyncio.sleep(SETTLE_S + max(1.0, QUIET_SPELL_X * longest))
        loads, hits, recomputes, infos, hit_infos = [], [], [], [], []
        windows, hit_windows, fresh_windows, spells = [], [], [], []
        for prompt, other in zip(prompts, fresh, strict=True):
            t_send = time.perf_counter()
            ttft_load, info = await _completion(client, prompt)
            await asyncio.sleep(0.5)
            t_hit = time.perf_counter()
            ttft_hit, hit_info = await _completion(client, prompt)
            hit_infos.append(hit_info)
            hit_windows.append((t_hit, t_hit + ttft_hit))
            await asyncio.sleep(0.5)
            t_fresh = time.perf_counter()
            ttft_recompute, _ = await _completion(client, other)
            fresh_windows.append((t_fresh, t_fresh + ttft_recompute))
            windows.append((max(quiet_since, t_send - ttft_load), t_send, t_send + ttft_load))
            spells.append((t_send - quiet_since) * 1e3)
            loads.append(ttft_load * 1e3)
            hits.append(ttft_hit * 1e3)
            recomputes.append(ttft_recompute * 1e3)
            infos.append(info)
            if between_loads is not None:
                await asyncio.to_thread(between_loads)
            gc.collect()
            # The next load's window without it lies in this spell (it is as long as that load's window), past
            # the streams' gap across the recompute, which ends in its first steps.
            longest = max(longest, ttft_load)
            quiet_since = time.perf_counter() + SETTLE_S
            await asyncio.sleep(SETTLE_S + max(1.0, QUIET_SPELL_X * longest))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    info = infos[0]
    return {"scenario": name, "loaded_by_tier": {t: n for t, n in info.get("cached_tokens_by_tier", {}).items() if n},
            "restore": info.get("restore"), "loads": len(loads),
            "device_hit_by_tier": {t: n for t, n in hit_infos[0].get("cached_tokens_by_tier", {}).items() if n},
            "ttft_load_ms": statistics.median(loads), "ttft_recompute_ms": statistics.median(recomputes),
            "ttft_device_hit_ms": statistics.median(hits),
            "ttft_load_all_ms": loads, "ttft_recompute_all_ms": recomputes, "ttft_device_hit_all_ms": hits,
            "window_ms": statistics.median((end - send) * 1e3 for _, send, end in windows),
            "baseline_window_ms": statistics.median((send - base) * 1e3 for base, send, _ in windows),
            "window_all_ms": [(end - send) * 1e3 for _, send, end in windows],
            "baseline_window_all_ms": [(send - base) * 1e3 for base, send, _ in windows],
            # The quiet spell before each load: its window without it is cut to the spell when the load ran past
            # QUIET_SPELL_X times the longest before it.
            "quiet_spell_all_ms": spells,
            "ttft_warm_load_ms": ttft_warm * 1e3,
            # Each load window's largest gap, and its window's without: where a pooled p99 comes from.
            "with_load_max_all_ms": [max(log.gaps_ms(send, end), default=None) for _, send, end in windows],
            "without_load_max_all_ms": [max(log.gaps_ms(base, send), default=None) for base, send, _ in windows],
            "without_load": _itl([g for base, send, _ in windows for g in log.gaps_ms(base, send)]),
            "with_load": _itl([g for _, send, end in windows for g in log.gaps_ms(send, end)]),
            "with_device_hit": _itl([g for start, end in hit_windows for g in log.gaps_ms(start, end)]),
            "with_recompute": _itl([g for start, end in fresh_windows for g in log.gaps_ms(start, end)]),
            "stream_errors": log.errors}


def _itl(gaps: list[float]) -> dict:
    if not gaps:
        return {"gaps": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"gaps": len(gaps), "p50_ms": percentile(gaps, 50), "p99_ms": percentile(gaps, 99), "max_ms": max(gaps)}


def _drop_page_cache(root: Path) -> None:
    """Evicts the disk tier's LMDB data file from the OS page cache (the pages no process has mapped)."""
    for path in root.rglob("data.mdb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the stores: a next turn right after a long turn ------------------------------------------------------


async def _next_turns(socket: Path, w: StallWorkload) -> dict:
    tok = ChatTokenizer.from_gguf(bundled_gguf_path())
    now, later = [], []
    async with async_client(socket) as client:
        await _chat(client, [{"role": "user", "content": "Say hello."}], 2)
        for i in range(2 * w.turn_repeats):  # alternating: right after, then later
            await _stores_drained(client)  # what is stored behind the next turn is its own turn's KV alone
            first = [{"role": "user", "content": f"{document(tok, w.turn_tokens, seed=100 + i)}\n\n{questions(1)[0]}"}]
            sid = f"bench-stall-{w.seed}-{i}-{time.time_ns()}"
            _, reply = await _chat(client, first, 8, session_id=sid)
            if i % 2:
                await asyncio.sleep(w.turn_later_s)
            history = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up(1)}]
            ttft, _ = await _chat(client, history, 4, session_id=sid)
            (later if i % 2 else now).append(ttft * 1e3)
    out = {"right_after_ms": statistics.median(now), "later_ms": statistics.median(later),
           "right_after_all_ms": now, "later_all_ms": later}
    out["x"] = out["right_after_ms"] / out["later_ms"]
    return out


async def _stores_drained(client: httpx.AsyncClient) -> None:
    """Waits until no lower tier of the daemon has writes pending (`/admin/tiers`): the long prompts stored
    before would otherwise still be written while a turn is measured."""
    end = time.monotonic() + DRAIN_S
    while any(t.get("pending_writes") for t in (await client.get("/admin/tiers")).json()["tiers"]):
        if time.monotonic() > end:
            raise ServeBenchError(f"the daemon's writes below the device did not end within {DRAIN_S:g} s")
        await asyncio.sleep(0.1)


# -- the run ----------------------------------------------------------------------------------------------


def run_stall_bench(w: StallWorkload) -> dict:
    unknown = set(w.scenarios) - set(SCENARIOS)
    if unknown or not w.scenarios:
        raise ServeBenchError(f"scenarios must be among {', '.join(SCENARIOS)}")
    if w.prompt_tokens < 32 or w.streams < 1:
        raise ServeBenchError("the prompt needs at least 32 tokens and one stream")
    if w.load_repeats < 1:
        raise ServeBenchError("load_repeats must be at least 1")
    if w.stream_priority not in (None, *QOS_CLASSES):
        raise ServeBenchError(f"the streams' priority must be one of {', '.join(QOS_CLASSES)}")
    rng = random.Random(w.seed)
    warm, *prompts = [_prompt(rng, w.prompt_tokens) for _ in range(1 + w.load_repeats)]
    root = Path(tempfile.mkdtemp(prefix="kvtd-stall-", dir="/tmp"))  # short: socket paths fit sun_path
    results: list[dict] = []
    try:
        secret = root / "fleet.secret"
        secret.write_bytes(os.urandom(32))
        with redis_server(root) as server:
            url = f"redis://127.0.0.1:{server.port}"
            writer = root / "w"
            writer.mkdir()
            with started_daemon(root=writer, env=_env(w, host=True, disk=True, remote_url=url, secret=secret,
                                                      admission="all")) as sock:
                asyncio.run(_store(sock, [warm, *prompts]))
                turns = asyncio.run(_next_turns(sock, w)) if w.turn_repeats else None
            for name in [s for s in SCENARIOS if s in w.scenarios]:
                other = random.Random(f"{w.seed}-{name}")
                fresh = [_prompt(other, w.prompt_tokens) for _ in range(w.load_repeats)]
                if name == "disk":
                    _drop_page_cache(writer)
                    with started_daemon(root=writer, env=_env(w, disk=True)) as sock:
                        results.append(asyncio.run(_measure(sock, w, name, warm, prompts, fresh,
                                                            between_loads=lambda: _drop_page_cache(writer))))
                    continue
                own = root / name.replace(" ", "-")
                own.mkdir()
                stop = _stopper(server) if name == "remote stopped" else None
                with _remote_url(name, server.port, w) as remote:
                    with started_daemon(root=own, env=_env(w, disk=False, remote_url=remote, secret=secret)) as sock:
                        results.append(asyncio.run(_measure(sock, w, name, warm, prompts, fresh, stop)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        base = r["without_load"]["p99_ms"]
        for key, window in (("itl_p99_x", "with_load"), ("device_hit_itl_p99_x", "with_device_hit"),
                            ("recompute_itl_p99_x", "with_recompute")):
            p99 = r[window]["p99_ms"]
            r[key] = p99 / base if base and p99 is not None else None
    return {"workload": asdict(w), "machine": machine(), "load_average": os.getloadavg(), "scenarios": results,
            "next_turn": turns, "targets": {"itl_p99_x": TARGET_ITL_P99_X, "next_turn_x": TARGET_NEXT_TURN_X}}


async def _store(socket: Path, prompts: list[list[int]]) -> None:
    """Each long prompt computed (its chunks go to the fleet) and hit once (flushed to disk at SIGTERM)."""
    async with async_client(socket) as client:
        for prompt in prompts:
            for _ in range(2):
                await _completion(client, prompt)


@contextmanager
def _remote_url(name: str, port: int, w: StallWorkload) -> Iterator[str]:
    if name != "remote slow":
        yield f"redis://127.0.0.1:{port}"
        return
    proxy = subprocess.Popen([sys.executable, "-m", "kvtierd.bench.slow_proxy", str(port), str(w.redis_delay_ms)],
                             stdout=subprocess.PIPE, text=True)
    try:
        yield f"redis://127.0.0.1:{int(proxy.stdout.readline())}"
    finally:
        proxy.terminate()
        proxy.wait(10)


def _stopper(server: subprocess.Popen):
    def stop() -> None:
        server.terminate()
        server.wait(10)
    return stop

