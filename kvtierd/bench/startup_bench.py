"""`kvtierd bench startup`: loading the model from its GGUF file against loading its cached conversion.

A restart's model load is most of the daemon's time to ready. Both loads run in this process, alternated
(GGUF, cache, GGUF, cache, ...), from a fresh cache directory: the first GGUF load also writes the
entry (timed apart as `convert and store`). The two models are checked equal (weights bit for bit,
fingerprint) before anything is reported.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtierd.model.loader import LoadedModel, load_model


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


def run_startup_bench(model: str | None, repeats: int) -> StartupFigures:
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
    g, c = statistics.median(gguf), statistics.median(cached)
    return StartupFigures(converted.name, repeats, convert_s, g, c, g / c, entry_bytes, equal)


def _same(a: LoadedModel, b: LoadedModel) -> bool:
    wa, wb = a.model.weights, b.model.weights
    pairs = [(wa.embed, wb.embed), (wa.final_norm, wb.final_norm), (wa.lm_head, wb.lm_head)]
    pairs += [(getattr(la, f), getattr(lb, f)) for la, lb in zip(wa.layers, wb.layers, strict=True)
              for f in ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")]
    return a.fingerprint == b.fingerprint and all(torch.equal(x, y) for x, y in pairs)
