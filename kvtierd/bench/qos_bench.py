"""`kvtierd bench qos`: high-priority TTFT and ITL under a low-priority flood, through the daemon.

Real `kvtierd serve` processes on Unix sockets, real clients over the socket
(httpx, streamed completions, SSE). Low clients flood: each sends long prompts
(`low_prompt_tokens` random token ids, nothing shared through the cache) for
`low_reply_tokens` replies, back to back, so a few times more requests are
in flight than the device pool holds. High requests arrive at scheduled
times, one every `high_every_s`, each from its own task; the stream starts
first, the flood joins it, and the samples are the high requests scheduled
after the flood's head start (a stream, not the first high request after a
quiet spell, which waits for a step planned with no high present):

    scheduled arrival ── first content chunk ── chunk ── chunk ...
    |<------------- TTFT -------------->|<- ITL ->|

The clock starts at the scheduled time, not when the client got to send.
Runs, same schedule in each:

    unloaded       the high stream alone (QoS daemon)
    qos            flood + stream, time-bounded steps ([qos] step_budget_ms auto)
    no budget      flood + stream, classes (admission, reserve, preemption) but step_budget_ms off
    no qos         flood + stream, every request normal, step_budget_ms off: one class

Low throughput is the text chunks the low clients received while the sampled
high stream ran, per second of it (a chunk is a token, or a few when text is
held back until it decodes cleanly: alike in every run); low TTFT and ITL are
of the low requests that ended in that time. The target compares qos with no
budget (QoS off: the step budget off).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvtierd.bench.report import machine
from kvtierd.bench.serve_bench import ServeBenchError, async_client, percentile, started_daemon

TARGET_TTFT_P95_X = 3.0  # high TTFT p95 under the flood, at most this many times the unloaded p95
TARGET_ITL_P95_X = 2.0
TARGET_LOW_THROUGHPUT = 0.8  # low tokens/s with QoS, at least this share of no budget's
RUNS = ("unloaded", "qos", "no budget", "no qos")
DEFAULT_RUNS = RUNS[:3]  # no qos queues high behind the flood, FIFO: minutes of TTFT, so asked for by name
VOCAB_SPAN = (1000, 40000)  # ordinary tokens of the bundled model, no special ones


@dataclass(frozen=True, slots=True)
class QosWorkload:
    high_requests: int = 100
    high_every_s: float = 1.0
    high_prompt_tokens: int = 40
    high_reply_tokens: int = 16
    low_clients: int = 16
    low_prompt_tokens: int = 1000
    low_reply_tokens: int = 64
    head_start_s: float = 5.0  # the flood fills the pages (the high stream running already) before the samples
    kv_cache: str = "128MiB"
    step_budget: str = "high=auto,normal=auto"  # the qos run's [qos] step_budget_ms
    seed: int = 0


@dataclass(slots=True)
class Timing:
    qos_class: str
    ttft_s: float
    gaps_s: list[float]
    output_tokens: int
    end: float  # perf_counter when it ended


@dataclass(slots=True)
class RunLog:
    timings: list[Timing] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # when each text chunk came, of every request
    errors: int = 0


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB_SPAN) for _ in range(n)]


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, priority: str,
                  start: float, chunk_times: list[float] | None = None) -> Timing:
    """One streamed completion; TTFT from `start` (perf_counter), which may be before it was sent. Each text
    chunk's arrival also goes to `chunk_times` as it comes (a request cut short still counts)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "priority": priority}
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServeBenchError(f"the daemon answered {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise ServeBenchError(f"the stream ended with an error: {chunk['error']}")
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
                if chunk_times is not None:
                    chunk_times.append(arrivals[-1])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    if not arrivals:
        raise ServeBenchError("a stream carried no text")
    return Timing(priority, arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens,
                  arrivals[-1])


async def _low_client(socket, w: QosWorkload, rng: random.Random, priority: str, log: RunLog) -> None:
    async with async_client(socket) as client:
        while True:
            try:
                log.timings.append(await _stream(client, _prompt(rng, w.low_prompt_tokens), w.low_reply_tokens,
                                                 priority, time.perf_counter(), log.chunk_times))
            except (ServeBenchError, httpx.HTTPError):
                log.errors += 1
                await asyncio.sleep(0.5)


async def _high_request(socket, w: QosWorkload, prompt: list[int], priority: str, at: float, log: RunLog) -> None:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    async with async_client(socket) as client:
        try:
            timing = await _stream(client, prompt, w.high_reply_tokens, priority, at)
        except (ServeBenchError, httpx.HTTPError):
            log.errors += 1
            return
    timing.qos_class = "high"
    log.timings.append(timing)


async def run_scenario(socket, w: QosWorkload, name: str, flood: bool, classes: bool) -> dict:
    """The high stream starts first and runs on; the flood joins it, fills the pages for `head_start_s`, and
    the high requests scheduled after that are the samples (the ones before are not measured)."""
    rng = random.Random(f"{w.seed}-{name}")
    high_priority, low_priority = ("high", "low") if classes else ("normal", "normal")
    warm_log, high_log, low_log = RunLog(), RunLog(), RunLog()
    start = time.perf_counter() + 0.5
    num_warm = math.ceil(w.head_start_s / w.high_every_s) if flood else 0
    t0 = start + num_warm * w.high_every_s  # the first sample
    highs = [asyncio.create_task(_high_request(socket, w, _prompt(rng, w.high_prompt_tokens), high_priority,
                                               start + i * w.high_every_s, high_log if i >= num_warm else warm_log))
             for i in range(num_warm + w.high_requests)]
    await asyncio.sleep(max(0.0, start + 0.1 - time.perf_counter()))  # the first high request is in
    lows = [asyncio.create_task(_low_client(socket, w, random.Random(rng.random()), low_priority, low_log))
            for _ in range(w.low_clients if flood else 0)]
    await asyncio.gather(*highs)
    t_end = time.perf_counter()
    for task in lows:
        task.cancel()
    await asyncio.gather(*lows, return_exceptions=True)
    low = [t for t in low_log.timings if t0 <= t.end <= t_end]
    return {"run": name, "high": _latencies(high_log.timings), "low": _latencies(low) if low else None,
            "high_errors": high_log.errors + warm_log.errors, "low_errors": low_log.errors,
            "low_tokens_per_s": sum(t0 <= t <= t_end for t in low_log.chunk_times) / (t_end - t0) if flood else None,
            "window_s": t_end - t0}


def _latencies(timings: list[Timing]) -> dict:
    ttft = [t.ttft_s * 1e3 for t in timings]
    itl = [g * 1e3 for t in timings for g in t.gaps_s]
    out = {"requests": len(timings)}
    for label, values in (("ttft", ttft), ("itl", itl)):
        for q in (50, 95, 99):
            out[f"{label}_p{q}_ms"] = percentile(values, q) if values else None
    return out


async def _warm_up(socket, w: QosWorkload) -> None:
    async with async_client(socket) as client:
        await _stream(client, _prompt(random.Random(-1), w.high_prompt_tokens), 4, "high", time.perf_counter())


def _daemon_env(w: QosWorkload, step_budget: bool) -> dict[str, str]:
    return {"KVTIERD_KV_CACHE_BYTES": w.kv_cache,
            "KVTIERD_QOS_MAX_QUEUE_S": "high=0,normal=0,low=0",  # no 503s: every request is measured
            "KVTIERD_STEP_BUDGET_MS": w.step_budget if step_budget else "",
            "KVTIERD_LOG_LEVEL": "warning"}


def run_qos_bench(w: QosWorkload, runs: tuple[str, ...] = DEFAULT_RUNS) -> dict:
    """The figures of each run asked for; two daemons: one with step budgets, one without."""
    unknown = set(runs) - set(RUNS)
    if unknown or not runs:
        raise ServeBenchError(f"runs must be among {', '.join(RUNS)}")
    results = []
    for step_budget, names in ((True, ("unloaded", "qos")), (False, ("no budget", "no qos"))):
        names = [n for n in names if n in runs]
        if not names:
            continue
        with started_daemon(env=_daemon_env(w, step_budget)) as socket:
            asyncio.run(_warm_up(socket, w))
            for name in names:
                results.append(asyncio.run(run_scenario(socket, w, name, flood=name != "unloaded",
                                                        classes=name != "no qos")))
    return {"workload": asdict(w), "machine": machine(), "runs": results, **_verdict(results)}


def _verdict(results: list[dict]) -> dict:
    by = {r["run"]: r for r in results}
    out: dict = {"targets": {"ttft_p95_x": TARGET_TTFT_P95_X, "itl_p95_x": TARGET_ITL_P95_X,
                             "low_throughput_share": TARGET_LOW_THROUGHPUT}}
    base = by.get("unloaded")
    for r in results:
        if base is not None and base["high"]["ttft_p95_ms"] and r["high"]["ttft_p95_ms"] is not None:
            r["ttft_p95_x"] = r["high"]["ttft_p95_ms"] / base["high"]["ttft_p95_ms"]
            if base["high"]["itl_p95_ms"] and r["high"]["itl_p95_ms"] is not None:
                r["itl_p95_x"] = r["high"]["itl_p95_ms"] / base["high"]["itl_p95_ms"]
    qos = by.get("qos")
    if qos is not None and "ttft_p95_x" in qos:
        out["ttft_target_met"] = qos["ttft_p95_x"] <= TARGET_TTFT_P95_X
        out["itl_target_met"] = qos.get("itl_p95_x", float("inf")) <= TARGET_ITL_P95_X
    # QoS off: the step budget off (the target's baseline), and one class for all when that run is asked for.
    for off, key in (("no budget", "low_throughput_share"), ("no qos", "low_throughput_share_vs_no_qos")):
        if qos is not None and off in by and by[off]["low_tokens_per_s"]:
            out[key] = qos["low_tokens_per_s"] / by[off]["low_tokens_per_s"]
    if "low_throughput_share" in out:
        out["throughput_target_met"] = out["low_throughput_share"] >= TARGET_LOW_THROUGHPUT
    return out
