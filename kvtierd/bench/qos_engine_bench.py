"""`kvtierd bench qos-engine`: high-priority TTFT under a flood of low-priority sessions, in one process
(the reserved region's runs; `kvtierd bench qos` measures the same through the daemon).

A small KV budget; a flood of low-priority sessions (long prompts, long
replies) submitted at once fills it, while a steady stream of high-priority
requests arrives, one every `high_every_s` seconds. Each run is a fresh
engine on the one loaded model, stepped synchronously:

    unloaded     the high stream alone: the TTFT to compare against
    reserved     the flood + the stream, QoS classes and a reserved region
    resizing     the same, the region resizing itself to high's page demand
                 (`reserved_window_s`); kept for `--plot`: its size over time,
                 (seconds, reserved pages, pages held by high) after each step
                 that changed either, and each resize (seconds, old, new,
                 the p99 of high's pages it followed)
    no reserve   the same, classes (admission, preemption) but no reserved region
    no qos       the same, every request normal: first come, first served

TTFT is engine time from a high request's scheduled arrival (it is added at
the first step boundary after it; the clock starts at the schedule, as a
client's would) to the step that returns the first token. Low throughput is the flood's generated tokens per second until its
last request ends; "lost to the reservation" compares reserved with no reserve.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

from kvtierd.engine.config import EngineConfig, QosConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import LoadedModel

TARGET_P95_X = 1.5  # high p95 TTFT with the reserve, at most this many times the unloaded one
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class QosWorkload:
    kv_pages: int = 64  # the device KV budget, in pages of 16 tokens
    low_sessions: int = 12
    low_prompt_tokens: int = 160
    low_reply_tokens: int = 48
    high_requests: int = 12
    high_prompt_tokens: int = 48
    high_reply_tokens: int = 4
    high_every_s: float = 0.25
    reserved_share: float = 0.25
    reserved_window_s: float = 1.0  # the resizing run: the reserve follows high's p99 pages over this window


def _prompt(loaded: LoadedModel, tag: str, num_tokens: int) -> list[int]:
    """A distinct prompt of about `num_tokens` tokens (nothing shared between requests)."""
    words = " ".join(f"{tag}-{i}" for i in range(num_tokens))
    return loaded.tokenizer.encode(words)[:num_tokens]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _qos_config(w: QosWorkload, reserve: bool, resize: bool) -> QosConfig:
    no_limit = {"high": 0.0, "normal": 0.0, "low": 0.0}
    if not resize:
        return QosConfig(reserved_share=w.reserved_share if reserve else 0.0, max_queue_s=no_limit)
    # The floor is one high request's pages: the first one after a quiet spell still finds its room.
    floor = math.ceil((w.high_prompt_tokens + w.high_reply_tokens) / BLOCK_SIZE) / w.kv_pages
    return QosConfig(reserved_share=w.reserved_share, reserved_min_share=min(floor, w.reserved_share),
                     reserved_window_s=w.reserved_window_s, max_queue_s=no_limit)


def run_scenario(loaded: LoadedModel, w: QosWorkload, name: str, flood: bool, qos: bool, reserve: bool,
                 resize: bool = False) -> dict:
    bytes_per_page = BLOCK_SIZE * 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim \
        * loaded.model.kv_dtype.itemsize
    engine = LLMEngine(loaded, EngineConfig(
        block_size=BLOCK_SIZE, kv_cache_bytes=w.kv_pages * bytes_per_page, max_num_batched_tokens=512,
        qos=_qos_config(w, reserve, resize)))
    pool = engine.kv.pool
    high_class, low_class = ("high", "low") if qos else ("normal", "normal")
    low_params = SamplingParams(max_tokens=w.low_reply_tokens, temperature=0.0, ignore_eos=True)
    high_params = SamplingParams(max_tokens=w.high_reply_tokens, temperature=0.0, ignore_eos=True)
    lows = set()
    t0 = time.perf_counter()
    t0_clock = time.monotonic()  # the reserve's clock: its resize times count from here
    if flood:
        lows = {engine.add_request(_prompt(loaded, f"low{i}", w.low_prompt_tokens), low_params,
                                   session_id=f"flood-{i}", qos_class=low_class) for i in range(w.low_sessions)}
    arrivals: dict[str, float] = {}
    ttft: dict[str, float] = {}
    low_tokens, low_end = 0, t0
    next_high = t0 + (w.high_every_s if flood else 0.0)  # the flood gets a head start to fill the pages
    series = [(0.0, pool.reserve.pages, 0)] if resize else []  # (seconds, reserved pages, pages held by high)
    while len(arrivals) < w.high_requests or engine.has_unfinished():
        now = time.perf_counter()
        if len(arrivals) < w.high_requests and now >= next_high:
            rid = engine.add_request(_prompt(loaded, f"high{len(arrivals)}", w.high_prompt_tokens), high_params,
                                     qos_class=high_class)
            arrivals[rid] = next_high  # the clock starts at the scheduled time, not when the loop got to it
            next_high += w.high_every_s
        if not engine.has_unfinished():
            time.sleep(max(0.0, next_high - time.perf_counter()))
            continue
        for o in engine.step():
            if o.request_id in arrivals and o.request_id not in ttft:
                ttft[o.request_id] = time.perf_counter() - arrivals[o.request_id]
            if o.request_id in lows:
                low_tokens += len(o.token_ids)
                if o.finished:
                    low_end = time.perf_counter()
        if resize and (pool.reserve.pages, pool.num_high_blocks) != series[-1][1:]:
            series.append((time.perf_counter() - t0, pool.reserve.pages, pool.num_high_blocks))
    if resize:  # the last size holds to the end of the run
        series.append((time.perf_counter() - t0, pool.reserve.pages, pool.num_high_blocks))
    values = [ttft[r] * 1e3 for r in arrivals]
    figures = {
        "run": name, "high_requests": len(values),
        "ttft_p50_ms": statistics.median(values), "ttft_p95_ms": _percentile(values, 0.95),
        "low_tokens_per_s": low_tokens / (low_end - t0) if flood and low_end > t0 else None,
        "preemptions": engine.counters.preemptions,
        "reserved_pages": pool.reserve.pages if pool.reserve else 0,
        "resizes": len(pool.reserve.history) if pool.reserve else 0,
        "kv_pages": pool.num_blocks,
    }
    if resize:
        figures.update(reserved_window_s=w.reserved_window_s, reserved_floor=pool.reserve.floor,
                       reserved_ceiling=pool.reserve.ceiling,
                       reserve_series=[[round(t, 4), pages, high] for t, pages, high in series],
                       reserve_resizes=[[round(r.at - t0_clock, 4), r.old_pages, r.new_pages, r.p99_pages]
                                        for r in pool.reserve.history])
    return figures


def run_qos_bench(loaded: LoadedModel, w: QosWorkload) -> dict:
    # Warm-up: first-call costs stay out of the figures.
    run_scenario(loaded, QosWorkload(high_requests=2, high_every_s=0.0), "warm-up", flood=False, qos=True,
                 reserve=False)
    runs = [
        run_scenario(loaded, w, "unloaded", flood=False, qos=True, reserve=True),
        run_scenario(loaded, w, "reserved", flood=True, qos=True, reserve=True),
        run_scenario(loaded, w, "resizing", flood=True, qos=True, reserve=True, resize=True),
        run_scenario(loaded, w, "no reserve", flood=True, qos=True, reserve=False),
        run_scenario(loaded, w, "no qos", flood=True, qos=False, reserve=False),
    ]
    by_name = {r["run"]: r for r in runs}
    unloaded, reserved, no_reserve = by_name["unloaded"], by_name["reserved"], by_name["no reserve"]
    for r in runs:
        r["p95_vs_unloaded_x"] = r["ttft_p95_ms"] / unloaded["ttft_p95_ms"]
    lost = None
    if reserved["low_tokens_per_s"] and no_reserve["low_tokens_per_s"]:
        lost = 1.0 - reserved["low_tokens_per_s"] / no_reserve["low_tokens_per_s"]
    return {"workload": asdict(w), "runs": runs, "low_throughput_lost_to_reserve": lost,
            "target_p95_x": TARGET_P95_X, "target_met": reserved["p95_vs_unloaded_x"] <= TARGET_P95_X}
