"""`kvtierd bench serve`: N concurrent streaming chat clients against the daemon.

Each client is one asyncio task with its own HTTP connection over the Unix
socket; it sends its requests one after another, each streamed (SSE) with
temperature 0. Per request:

    t_send ── first content chunk ── chunk ── chunk ── ... ── usage chunk ── [DONE]
    |<-------- TTFT -------->|<- gap ->|<- gap ->|
                                 (inter-token latency, ITL)

A content chunk may carry more than one token (text held back until it decodes
cleanly), so ITL is the gap between content chunks as a client sees them.
Output tokens are counted from the final usage chunk. Throughput for a level is
all its clients' output tokens (and requests) over the level's wall time.

EOS is not ignored (the API has no such field): the prompts ask for long
stories so that most requests run to max_tokens; the figures say how many did.
Every request has its own prompt across the whole run, distinct from its first
word, so requests share only the chat template's system prefix in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BASE_URL = "http://kvtierd"
KV_CACHE_BYTES = "512MiB"  # for a daemon the bench starts itself, unless KVTIERD_KV_CACHE_BYTES is set
READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 900.0

SUBJECTS = ("A lighthouse keeper", "Two rival bakers", "An old clockmaker", "A lost robot", "A young cartographer",
            "A retired pirate", "A stubborn goat", "A travelling violinist", "A shy dragon", "Three siblings",
            "A night-shift nurse", "A beekeeper")
PLACES = ("on a frozen lake", "in a desert town", "under the sea", "on a night train", "in a mountain village",
          "on a distant moon", "in a flooded city", "in a bamboo forest", "at a busy harbour", "in a library",
          "on a floating island", "in a salt mine")


class ServeBenchError(Exception):
    """The daemon could not be started or reached, or it refused a request."""


def story_prompts(n: int, seed: int) -> list[str]:
    """n distinct prompts asking for long answers; they differ from their first words on."""
    combos = [(s, p) for s in SUBJECTS for p in PLACES]
    random.Random(seed).shuffle(combos)
    out = []
    for i in range(n):
        subject, place = combos[i % len(combos)]
        part = f" (story number {i // len(combos) + 1})" if i >= len(combos) else ""
        out.append(f"{subject} {place}{part}: write a long, detailed story about them, with many chapters.")
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(slots=True)
class RequestTiming:
    ttft_s: float
    gaps_s: list[float]  # between consecutive content chunks
    output_tokens: int
    cached_tokens: int
    finish_reason: str | None


@dataclass(slots=True)
class LevelResult:
    clients: int
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)

    def figures(self, max_tokens: int) -> dict:
        ttfts = [t.ttft_s * 1e3 for t in self.timings]
        gaps = [g * 1e3 for t in self.timings for g in t.gaps_s]
        tokens = sum(t.output_tokens for t in self.timings)
        return {
            "clients": self.clients,
            "requests": len(self.timings),
            "ttft_ms_p50": percentile(ttfts, 50),
            "ttft_ms_p95": percentile(ttfts, 95),
            "itl_ms_p50": percentile(gaps, 50) if gaps else None,
            "itl_ms_p95": percentile(gaps, 95) if gaps else None,
            "output_tokens": tokens,
            "output_tok_s": tokens / self.wall_s,
            "req_s": len(self.timings) / self.wall_s,
            "wall_s": self.wall_s,
            "reached_max_tokens": sum(t.output_tokens >= max_tokens for t in self.timings),
            "cached_prompt_tokens": sum(t.cached_tokens for t in self.timings),
        }


def async_client(socket: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket)), base_url=BASE_URL,
                             timeout=REQUEST_TIMEOUT_S)


async def sse_chunks(client: httpx.AsyncClient, path: str, body: dict) -> AsyncIterator[dict]:
    """The JSON chunks of one streamed POST, as they arrive; an answer other than 200, or an error chunk in the
    stream, raises ServeBenchError."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServeBenchError(f"the daemon answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServeBenchError(f"the stream ended with an error: {chunk['error']}")
            yield chunk


async def stream_chat(client: httpx.AsyncClient, prompt: str, max_tokens: int, seed: int) -> RequestTiming:
    """One streamed chat completion, timed chunk by chunk as it arrives."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    usage: dict | None = None
    finish_reason = None
    t_send = time.perf_counter()
    async for chunk in sse_chunks(client, "/v1/chat/completions", body):
        for choice in chunk.get("choices", []):
            if choice.get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
            finish_reason = choice.get("finish_reason") or finish_reason
        usage = chunk.get("usage") or usage
    if not arrivals:
        raise ServeBenchError("a stream carried no content chunk")
    if usage is None:
        raise ServeBenchError("the stream had no usage chunk (stream_options.include_usage)")
    return RequestTiming(
        ttft_s=arrivals[0] - t_send,
        gaps_s=[b - a for a, b in zip(arrivals, arrivals[1:])],
        output_tokens=usage["completion_tokens"],
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        finish_reason=finish_reason,
    )


async def run_client(socket: Path, prompts: list[str], max_tokens: int, seed: int) -> list[RequestTiming]:
    async with async_client(socket) as client:
        return [await stream_chat(client, p, max_tokens, seed) for p in prompts]


async def run_level(socket: Path, prompts: list[list[str]], max_tokens: int, seed: int) -> LevelResult:
    """len(prompts) clients at once, client i sending prompts[i] in turn."""
    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(run_client(socket, ps, max_tokens, seed) for ps in prompts))
    result = LevelResult(clients=len(prompts), wall_s=time.perf_counter() - t0)
    for timings in per_client:
        result.timings.extend(timings)
    return result


async def bench_socket(socket: Path, clients: list[int], requests_per_client: int, max_tokens: int,
                       seed: int) -> dict:
    async with async_client(socket) as client:
        try:
            health = (await client.get("/healthz")).json()
        except httpx.TransportError as e:
            raise ServeBenchError(f"no daemon answers on {socket} ({e}); start one with "
                                  "`kvtierd serve`, or leave out --socket to let the bench start one") from e
    prompts = iter(story_prompts(1 + requests_per_client * sum(clients), seed))
    await run_level(socket, [[next(prompts)]], 2, seed)  # warm-up, not reported
    levels = []
    for n in clients:
        per_client = [[next(prompts) for _ in range(requests_per_client)] for _ in range(n)]
        levels.append((await run_level(socket, per_client, max_tokens, seed)).figures(max_tokens))
    return {"model": health.get("model"), "max_tokens": max_tokens, "requests_per_client": requests_per_client,
            "seed": seed, "levels": levels}


def _wait_ready(process: subprocess.Popen, socket: Path, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url=BASE_URL, timeout=10) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServeBenchError(f"kvtierd exited with {process.returncode}:\n{_tail(log)}")
            if socket.exists():
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/healthz").status_code == 200:
                        return
            time.sleep(0.2)
    raise ServeBenchError(f"kvtierd was not ready within {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop_daemon(process: subprocess.Popen) -> None:
    """SIGTERM (the daemon drains and flushes), SIGKILL only if it has not exited a minute later."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def started_daemon(timeout: float = READY_TIMEOUT_S, root: Path | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Path]:
    """A `kvtierd serve` subprocess on a temporary socket and state dir; SIGTERM on exit. `env` adds settings.

    The directory is short and under /tmp: a socket path must fit sun_path (~107 bytes). Given a `root`,
    the daemon uses it and leaves it (a restart in it finds the state of the one before)."""
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix="kvtierd-bench-", dir="/tmp")) if root is None else root
    socket, log = root / "kvtierd.sock", root / "daemon.log"
    env = {**os.environ, "KVTIERD_KV_CACHE_BYTES": os.environ.get("KVTIERD_KV_CACHE_BYTES", KV_CACHE_BYTES),
           **(env or {})}
    cmd = [sys.executable, "-m", "kvtierd.cli.main", "serve", "--socket", str(socket), "--state-dir", str(root / "state")]
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(process, socket, log, timeout)
        yield socket
    finally:
        stop_daemon(process)
        if own_root:
            shutil.rmtree(root, ignore_errors=True)


def run_serve_bench(socket: Path | None, clients: list[int], requests_per_client: int = 2, max_tokens: int = 32,
                    seed: int = 0) -> dict:
    """The figures for each concurrency level; starts (and stops) a daemon when no socket is given."""
    if not clients or min(clients) < 1 or requests_per_client < 1 or max_tokens < 1:
        raise ServeBenchError("clients, requests per client and max tokens must be at least 1")
    if socket is not None:
        return {"daemon": "external", **asyncio.run(bench_socket(socket, clients, requests_per_client, max_tokens, seed))}
    with started_daemon() as own:
        figures = asyncio.run(bench_socket(own, clients, requests_per_client, max_tokens, seed))
    kv = os.environ.get("KVTIERD_KV_CACHE_BYTES", KV_CACHE_BYTES)
    return {"daemon": f"started by the bench (KVTIERD_KV_CACHE_BYTES={kv})", **figures}
