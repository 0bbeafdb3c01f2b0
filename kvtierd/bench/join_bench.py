"""`kvtierd bench join`: the steps in which a long cached prompt's last token joins running streams, its layers
split over two steps (a split join, engine/scheduler.py) beside all of them in one.

In one process, the bundled model at the daemon's defaults: `streams` chat
streams decode; a prompt of `context_len` tokens (whole pages: all of it is
found on the device but its last token, left to compute) is sent again and
again with one token to generate, and the steps it is in are timed, split and
whole alternating (the scheduler's share set so that every such token splits,
or none does), the streams' plain steps between them. What the streams feel
is the longest of those steps: their inter-token gap while the long context
joins them.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import load_model

PLAIN_STEPS = 4  # the streams' own steps timed before each join
STREAM_PROMPT_TOKENS = 64


def run_join_bench(context_len: int = 2560, streams: int = 3, joins: int = 20, kv_cache_bytes: int = 512 << 20,
                   seed: int = 0) -> dict:
    loaded = load_model(None, "cpu")
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=kv_cache_bytes))
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prompt = tokens(context_len // engine.kv.block_size * engine.kv.block_size)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))  # its pages cached
    # The streams outlast the bench: each join takes three steps at most, and PLAIN_STEPS go before each.
    stream = SamplingParams(max_tokens=2 * joins * (PLAIN_STEPS + 3) + 4 * PLAIN_STEPS, temperature=0.0,
                            ignore_eos=True)
    for _ in range(streams):
        engine.add_request(tokens(STREAM_PROMPT_TOKENS), stream)
    for _ in range(2 * PLAIN_STEPS):  # the streams decoding, warm
        engine.step()
    plain: list[float] = []
    timed: dict[bool, list[list[float]]] = {True: [], False: []}
    for _ in range(joins):
        for split in (True, False):
            engine.scheduler.join_split_share = 0.0 if split else math.inf
            for _ in range(PLAIN_STEPS):
                plain.append(_timed_step(engine))
            rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            steps = []
            while rid in engine.requests:
                steps.append(_timed_step(engine))
            timed[split].append(steps)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return {"context_len": len(prompt), "streams": streams, "joins": joins, "threads": torch.get_num_threads(),
            "plain_ms": statistics.median(plain),
            "split": _figures(timed[True]), "whole": _figures(timed[False])}


def _timed_step(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t) * 1e3


def _figures(joins: list[list[float]]) -> dict:
    """Medians over the joins: the steps' count, each step, the longest and its p90, their sum."""
    longest = sorted(max(steps) for steps in joins)
    num_steps = max(len(steps) for steps in joins)
    return {"steps": num_steps,
            "each_ms": [statistics.median(s[i] for s in joins if len(s) > i) for i in range(num_steps)],
            "longest_ms": statistics.median(longest), "longest_p90_ms": longest[int(0.9 * (len(longest) - 1))],
            "total_ms": statistics.median(sum(steps) for steps in joins)}
