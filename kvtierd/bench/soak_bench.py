"""`kvtierd bench soak`: many sessions and requests over a while, with clients that
hang up mid-stream at random and some bad requests, then checks that the daemon is
back where it started.

Each round, every session posts one streamed message (a bounded number at once);
with probability `disconnect_p` its client closes the stream after the first
chunk. Beside them run stateless chats and requests that must be refused (4xx).
Reported: requests served, cut off and refused, errors by kind, and the daemon's
RSS and pages before and after. The baseline is taken after a warm-up round, so
allocator growth on first use is not counted as a leak. Pages in use must come
back to zero when the daemon is idle; RSS within `rss_tolerance` of the baseline.

The daemon's pid comes from SO_PEERCRED on its socket, so an external daemon on
this machine is measured the same way.
"""

from __future__ import annotations

import asyncio
import random
import socket as socketlib
import struct
import time
from collections import Counter
from pathlib import Path

import httpx

from kvtierd.bench.serve_bench import BASE_URL, started_daemon

RSS_TOLERANCE = 0.10  # RSS may end this much above its baseline
BAD_BODIES = ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"max_tokens": -1},
              {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})


def daemon_pid(socket: Path) -> int:
    with socketlib.socket(socketlib.AF_UNIX) as s:
        s.connect(str(socket))
        pid, _, _ = struct.unpack("3i", s.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_PEERCRED, 12))
    return pid


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def snapshot(client: httpx.AsyncClient, pid: int) -> dict:
    """RSS and pages once the daemon has nothing running and no page in use (waits, 10 s at most, for hung-up
    requests to be cancelled and finished turns' stores, which wait for an idle spell, to let go of theirs)."""
    for _ in range(200):
        engine = (await client.get("/admin/status")).json()["engine"]
        if engine["running"] == engine["waiting"] == engine["used_blocks"] == 0:
            break
        await asyncio.sleep(0.05)
    return {"rss_bytes": rss_bytes(pid), "used_blocks": engine["used_blocks"], "free_blocks": engine["free_blocks"],
            "cached_blocks": engine["cached_blocks"], "running": engine["running"]}


async def session_turn(client: httpx.AsyncClient, sid: str, text: str, max_tokens: int, hang_up: bool,
                       outcomes: Counter) -> None:
    body = {"content": text, "stream": True, "max_tokens": max_tokens, "temperature": 0}
    try:
        async with client.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
            if r.status_code != 200:
                outcomes[f"http {r.status_code}"] += 1
                return
            async for line in r.aiter_lines():
                if hang_up and line.startswith("data:"):
                    outcomes["cut off by the client"] += 1
                    return
                if line == "data: [DONE]":
                    outcomes["served"] += 1
                    return
            outcomes["stream ended without [DONE]"] += 1
    except httpx.HTTPError as e:
        outcomes[f"transport: {type(e).__name__}"] += 1


async def stateless(client: httpx.AsyncClient, text: str, max_tokens: int, outcomes: Counter) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                        "max_tokens": max_tokens, "temperature": 0})
    outcomes["served" if r.status_code == 200 else f"http {r.status_code}"] += 1


async def refused(client: httpx.AsyncClient, body: dict, outcomes: Counter) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    outcomes["refused (4xx)" if 400 <= r.status_code < 500 else f"http {r.status_code} for a bad request"] += 1


async def soak(socket: Path, sessions: int, rounds: int, concurrency: int, max_tokens: int, disconnect_p: float,
               seed: int) -> dict:
    rng = random.Random(seed)
    pid = daemon_pid(socket)
    limits = httpx.Limits(max_connections=concurrency + 4)
    transport = httpx.AsyncHTTPTransport(uds=str(socket), limits=limits)
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=600) as client:
        ids = [(await client.post("/v1/sessions", json={"title": f"soak {i}"})).json()["id"] for i in range(sessions)]
        gate = asyncio.Semaphore(concurrency)
        outcomes: Counter = Counter()

        async def bounded(coro):
            async with gate:
                await coro

        async def one_round(r: int, counts: Counter) -> None:
            jobs = [session_turn(client, sid, f"Round {r}: tell me something about item {i}.", max_tokens,
                                 rng.random() < disconnect_p, counts) for i, sid in enumerate(ids)]
            jobs += [stateless(client, f"Stateless question {r}.{k}", max_tokens, counts) for k in range(2)]
            jobs += [refused(client, rng.choice(BAD_BODIES), counts)]
            await asyncio.gather(*(bounded(j) for j in jobs))

        await one_round(-1, Counter())  # warm-up: first-use allocations are not a leak
        before = await snapshot(client, pid)
        t0 = time.perf_counter()
        for r in range(rounds):
            await one_round(r, outcomes)
        wall = time.perf_counter() - t0
        after = await snapshot(client, pid)
        errors_5xx = (await client.get("/admin/stats")).json()["errors_5xx"]
    growth = after["rss_bytes"] / before["rss_bytes"] - 1
    return {
        "sessions": sessions, "rounds": rounds, "concurrency": concurrency, "max_tokens": max_tokens,
        "disconnect_p": disconnect_p, "wall_s": wall, "outcomes": dict(outcomes),
        "requests": sum(outcomes.values()), "errors_5xx": errors_5xx,
        "before": before, "after": after, "rss_growth": growth, "rss_tolerance": RSS_TOLERANCE,
        "pages_back_to_baseline": after["used_blocks"] == before["used_blocks"] == 0,
        "rss_within_tolerance": growth <= RSS_TOLERANCE,
    }


def run_soak_bench(socket: Path | None, sessions: int = 16, rounds: int = 5, concurrency: int = 8,
                   max_tokens: int = 16, disconnect_p: float = 0.3, seed: int = 0) -> dict:
    """Soaks a daemon at `socket`, or one the bench starts (and stops) itself."""
    if socket is not None:
        return {"daemon": "external", **asyncio.run(soak(socket, sessions, rounds, concurrency, max_tokens,
                                                         disconnect_p, seed))}
    with started_daemon() as own:
        figures = asyncio.run(soak(own, sessions, rounds, concurrency, max_tokens, disconnect_p, seed))
    return {"daemon": "started by the bench", **figures}
