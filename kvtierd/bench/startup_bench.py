"""`kvtierd bench startup`: loading the model from its GGUF file against loading its cached conversion,
and a fresh daemon's time from process start to its first token.

A restart's model load is most of the daemon's time to ready. Both loads run in this process, alternated
(GGUF, cache, GGUF, cache, ...), from a fresh cache directory: the first GGUF load also writes the
entry (timed apart as `convert and store`). The two models are checked equal (weights bit for bit,
fingerprint) before anything is reported.

What a user waits for is more than the load: a fresh `kvtierd serve` process (Python and torch imported,
settings, the model mapped from the same cache entry, the socket bound) until /healthz answers, then
its first request's first streamed token (the first forward faults the mapped weights' pages in and
warms torch's kernels). The entry was just written, so its file is in the OS page cache: a restart's
case, not a cold boot's.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from kvtierd.bench.serve_bench import stop_daemon
from kvtierd.model.loader import LoadedModel, load_model

READY_GUARD_S = 300.0  # a daemon not ready by then is broken, not slow
FIRST_PROMPT = [{"role": "user", "content": "Say hello."}]


@dataclass(frozen=True, slots=True)
class StartupFigures:
    model: str
    repeats: int
    convert_and_store_s: float  # the first load: GGUF read, dequantized, and the cache entry written
    gguf_s: float  # median load from the GGUF, no cache
    cached_s: float  # median load from the cache entry
    speedup: float
    entry_bytes: int  # what the cache entry takes on disk
    equal: bool  # the cached model's weights and fingerprint equal the GGUF's
    processes: int  # fresh daemons started
    process_ready_s: float  # median: process start to /healthz answering
    process_first_token_s: float  # median: process start to the first streamed token of a first request
    first_request_ttft_s: float  # median: that request's own time to first token


def run_startup_bench(model: str | None, repeats: int, processes: int = 3) -> StartupFigures:
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-startup-") as tmp:
        cache = Path(tmp)
        t0 = time.perf_counter()
        converted = load_model(model, cache_dir=cache)
        convert_s = time.perf_counter() - t0
        gguf, cached = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plain = load_model(model)
            gguf.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mapped = load_model(model, cache_dir=cache)
            cached.append(time.perf_counter() - t0)
        equal = _same(plain, mapped) and _same(converted, mapped)
        entry_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        del plain, mapped  # the daemons below get this memory
        starts = [_process_to_first_token(model, cache) for _ in range(processes)]
    g, c = statistics.median(gguf), statistics.median(cached)
    ready, first, ttft = (statistics.median(x) for x in zip(*starts, strict=True))
    return StartupFigures(converted.name, repeats, convert_s, g, c, g / c, entry_bytes, equal, processes, ready,
                          first, ttft)


def _process_to_first_token(model: str | None, cache: Path) -> tuple[float, float, float]:
    """Seconds from starting a `kvtierd serve` process to /healthz answering and to its first request's first
    streamed token, and that request's own TTFT."""
    root = Path(tempfile.mkdtemp(prefix="kvtd-startup-", dir="/tmp"))  # short: a socket path fits sun_path
    sock = root / "kvtierd.sock"
    env = {**os.environ, "KVTIERD_MODEL_CACHE_DIR": str(cache), "KVTIERD_KV_CACHE_BYTES": "256MiB"}
    if model is not None:
        env["KVTIERD_MODEL"] = model
    cmd = [sys.executable, "-m", "kvtierd.cli.main", "serve", "--socket", str(sock), "--state-dir", str(root / "state")]
    with (root / "daemon.log").open("wb") as log:
        t0 = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://kvtierd",
                          timeout=READY_GUARD_S) as client:
            ready = _wait_ready(process, client, sock, t0, root / "daemon.log")
            body = {"messages": FIRST_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
            sent = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"the fresh daemon answered {r.status_code}")
                for line in r.iter_lines():
                    if line.startswith("data: {") and first is None:
                        delta = json.loads(line[6:])["choices"][0]["delta"] if '"choices"' in line else {}
                        if delta.get("content"):
                            first = time.perf_counter()
            if first is None:
                raise RuntimeError("the fresh daemon's reply carried no token")
        return ready, first - t0, first - sent
    finally:
        stop_daemon(process)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(process: subprocess.Popen, client: httpx.Client, sock: Path, t0: float, log: Path) -> float:
    while time.perf_counter() - t0 < READY_GUARD_S:
        if process.poll() is not None:
            raise RuntimeError(f"kvtierd exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if sock.exists():
            try:
                if client.get("/healthz").status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
        time.sleep(0.01)
    raise RuntimeError(f"kvtierd was not ready in {READY_GUARD_S:.0f} s:\n{log.read_text()[-3000:]}")


def _same(a: LoadedModel, b: LoadedModel) -> bool:
    ta, tb = a.model.weights.named_tensors(), b.model.weights.named_tensors()
    return a.fingerprint == b.fingerprint and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
