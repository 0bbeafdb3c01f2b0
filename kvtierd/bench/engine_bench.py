"""`kvtierd bench engine`: decode and prefill speed beside transformers, in one run.

Decode speed is measured on decode steps only (prefill excluded) with EOS
ignored, so both sides produce the same number of tokens. Batch-1 decode
streams every weight once per token; its weight bytes/s is reported beside the
machine's memory read bandwidth, measured here with a large tensor reduction.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass

import torch

from kvtierd.bench.report import median_time
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import LoadedModel

DECODE_TOKENS = 32


def memory_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a full read of a buffer far larger than the caches."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    return num_bytes / median_time(lambda: x.sum(), repeats)


def _prompts(loaded: LoadedModel, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens (no padding needed on either side)."""
    base = loaded.tokenizer.encode(
        "The history of caching in computer systems begins with the observation that programs reuse data. "
    )
    out = []
    for i in range(n):
        ids = loaded.tokenizer.encode(f"Request {i}: ") + base * (length // len(base) + 1)
        out.append(ids[:length])
    return out


@dataclass(slots=True)
class DecodeResult:
    tokens_per_s: float
    step_overhead_ms: float  # median of step time minus forward time


def engine_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> DecodeResult:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # prefill, not timed
    produced, overheads = 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        produced += len(engine.step())
        overheads.append((engine.last_step.total_s - engine.last_step.forward_s) * 1e3)
    return DecodeResult(produced / (time.perf_counter() - t0), statistics.median(overheads))


def engine_prefill_s(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds of one cold prefill: a fresh tenant, so the prefix cache never hits."""
    cached = engine.counters.cached_tokens
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant=uuid.uuid4().hex)
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - t0
    assert engine.counters.cached_tokens == cached, "a cold prefill hit the cache"
    return elapsed


PREFILL_PAIRS = 5


class TransformersBaseline:
    """transformers' own `generate` on the same GGUF weights (float32, CPU)."""

    def __init__(self, loaded: LoadedModel) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:  # it is only a benchmark/test dependency
            raise SystemExit("the engine benchmark compares against transformers: pip install -e '.[test]'") from e
        src = loaded.source
        self.model = AutoModelForCausalLM.from_pretrained(
            src.parent if src.is_file() else src,
            **({"gguf_file": src.name} if src.is_file() else {}),
            dtype=torch.float32,
        ).eval()

    @torch.inference_mode()
    def generate_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - t0

    def decode_tokens_per_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        self.generate_s(prompts, 2)  # warm-up
        prefill = min(self.generate_s(prompts, 1) for _ in range(2))
        total = self.generate_s(prompts, new_tokens + 1)
        return len(prompts) * new_tokens / (total - prefill)

    def prefill_s(self, prompt: list[int]) -> float:
        return self.generate_s([prompt], 1)


def run_engine_bench(loaded: LoadedModel, batches: list[int], prefill_lengths: list[int]) -> dict:
    hf = TransformersBaseline(loaded)
    bandwidth = memory_read_bandwidth()
    weight_bytes = loaded.model.weights.num_bytes_per_token()
    decode_rows = []
    for b in batches:
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=max(64, b)))
        prompts = _prompts(loaded, b, 64)
        engine_decode(engine, prompts[:1], 4)  # warm-up
        ours = engine_decode(engine, prompts, DECODE_TOKENS)
        theirs = hf.decode_tokens_per_s(prompts, DECODE_TOKENS)
        row = {
            "batch": b,
            "kvtierd_tok_s": ours.tokens_per_s,
            "transformers_tok_s": theirs,
            "speedup": ours.tokens_per_s / theirs,
            "step_overhead_ms": ours.step_overhead_ms,
        }
        if b == 1:
            row["weight_GB_s"] = weight_bytes * ours.tokens_per_s / 1e9
            row["share_of_mem_bw"] = weight_bytes * ours.tokens_per_s / bandwidth
        decode_rows.append(row)

    engine = LLMEngine(loaded)
    prefill_rows = []
    for n in prefill_lengths:
        prompt = _prompts(loaded, 1, n)[0]
        engine_prefill_s(engine, prompt[:16])  # warm-up
        hf.prefill_s(prompt[:16])
        # Alternating pairs, so drift in the machine's speed hits both sides alike.
        pairs = [(engine_prefill_s(engine, prompt), hf.prefill_s(prompt)) for _ in range(PREFILL_PAIRS)]
        ours = n / statistics.median(o for o, _ in pairs)
        theirs = n / statistics.median(t for _, t in pairs)
        ratio = statistics.median(t / o for o, t in pairs)
        prefill_rows.append({"tokens": n, "kvtierd_tok_s": ours, "transformers_tok_s": theirs, "speedup": ratio})

    overhead = engine_overhead_at(loaded, 64)
    return {
        "memory_read_GB_s": bandwidth / 1e9,
        "weight_bytes_per_token": weight_bytes,
        "decode": decode_rows,
        "prefill": prefill_rows,
        "step_overhead_ms_at_64": overhead,
    }


def engine_overhead_at(loaded: LoadedModel, num_seqs: int) -> float:
    """Median per-step time outside the model forward with `num_seqs` decoding."""
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=num_seqs))
    return engine_decode(engine, _prompts(loaded, num_seqs, 32), 16).step_overhead_ms
