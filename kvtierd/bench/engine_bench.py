"""`kvtierd bench engine`: decode and prefill speed of each weight mode beside transformers and
llama.cpp (when `llama_cpp` is importable) on the same GGUF, in one run, on the same thread count.

Decode speed is measured on decode steps only (prefill excluded) with EOS
ignored, so every side produces the same number of tokens. Batch-1 decode
streams every weight once per token; its weight bytes/s is reported beside the
machine's memory read bandwidth, measured here with a large tensor reduction.
The modes' decode, every side's prefill and the modes' warm turns run in
alternating rounds (every side once per round), so drift in the machine's speed
(another process's load) hits all alike; ratios are medians of per-round ratios.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import dataclass

import torch

from kvtierd.bench.report import machine, median_time
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import LoadedModel, convert_loaded

DECODE_TOKENS = 32
DECODE_ROUNDS = 3
WARM_PREFIX_TOKENS = 1500  # a chat's history, cached
WARM_NEW_TOKENS = 35  # the new user message of the next turn
WARM_TURNS = 9


def cpu_description() -> str:
    """The CPU's model name and the ISA flags that decide which kernels run."""
    m = machine()
    return f"{m['cpu']} [{' '.join(m['isa']) or 'no AVX2/AVX-512/AMX'}]"


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


class LlamaCppBaseline:
    """llama.cpp (llama-cpp-python) on the same GGUF file, on `threads` threads. Only a benchmark's
    yardstick: the project never depends on it; None from `load` when it is not installed."""

    def __init__(self, llama) -> None:
        self.llama = llama

    @classmethod
    def load(cls, loaded: LoadedModel, threads: int, n_ctx: int) -> "LlamaCppBaseline | None":
        try:
            from llama_cpp import Llama
        except ImportError:
            return None
        return cls(Llama(model_path=str(loaded.source), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False))

    def decode_tokens_per_s(self, prompt: list[int], new_tokens: int) -> float:
        """Batch 1: the prompt evaluated, then one token at a time (the same token ids as a greedy run
        would feed cost the same: llama.cpp's decode does not look at them)."""
        self.llama.reset()
        self.llama.eval(prompt)
        t0 = time.perf_counter()
        for i in range(new_tokens):
            self.llama.eval([prompt[i % len(prompt)]])
        return new_tokens / (time.perf_counter() - t0)

    def prefill_s(self, prompt: list[int]) -> float:
        self.llama.reset()
        t0 = time.perf_counter()
        self.llama.eval(prompt)
        return time.perf_counter() - t0


def warm_turn_ttft_s(engines: dict[str, LLMEngine], loaded: LoadedModel, session: bool, turns: int = WARM_TURNS
                     ) -> dict[str, float]:
    """Each engine's median time to the first token of a chat turn of WARM_NEW_TOKENS new tokens over a
    cached WARM_PREFIX_TOKENS-token history (the history computed once before); the engines take their turns
    alternately. `session`: the turns are a session's, as the daemon runs a chat, and start from its context
    pool (only the new tokens are computed); else they find the history in the prefix index, which holds
    whole pages only (the last, partly filled page of the history is computed again)."""
    history = _prompts(loaded, 1, WARM_PREFIX_TOKENS)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tenant, session_id = ("warm-session", "chat") if session else ("warm-prefix", None)
    cached_at_least = WARM_PREFIX_TOKENS if session else WARM_PREFIX_TOKENS - WARM_PREFIX_TOKENS % \
        next(iter(engines.values())).config.block_size

    def ttft_s(engine: LLMEngine, prompt: list[int]) -> float:
        cached = engine.counters.cached_tokens
        t0 = time.perf_counter()
        engine.add_request(prompt, params, tenant=tenant, session_id=session_id)
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - t0
        assert prompt is history or engine.counters.cached_tokens - cached >= cached_at_least, "history missed"
        return elapsed

    for engine in engines.values():
        ttft_s(engine, history)  # the history, computed once
    times: dict[str, list[float]] = {mode: [] for mode in engines}
    for turn in range(turns):
        question = f" Turn {turn}: why do programs reuse the data they touched a moment ago? " * 4
        new = loaded.tokenizer.encode(question)[:WARM_NEW_TOKENS]
        for mode, engine in engines.items():
            times[mode].append(ttft_s(engine, history + new))
    return {mode: statistics.median(t) for mode, t in times.items()}


def run_engine_bench(loaded: LoadedModel, batches: list[int], prefill_lengths: list[int], modes: list[str],
                     threads: int) -> dict:
    """`loaded` is the float32 model; each other mode is converted from it."""
    torch.set_num_threads(threads)
    models = {m: loaded if m == "float32" else convert_loaded(loaded, m) for m in dict.fromkeys(["float32", *modes])}
    hf = TransformersBaseline(loaded)
    llama = LlamaCppBaseline.load(loaded, threads, n_ctx=max([*prefill_lengths, 64 + DECODE_TOKENS]) + 16)
    bandwidth = memory_read_bandwidth()
    decode_rows = []
    for b in batches:
        prompts = _prompts(loaded, b, 64)
        engines = {mode: LLMEngine(lm, EngineConfig(max_num_seqs=max(64, b))) for mode, lm in models.items()}
        for engine in engines.values():
            engine_decode(engine, prompts[:1], 4)  # warm-up
        rounds = [{mode: engine_decode(e, prompts, DECODE_TOKENS) for mode, e in engines.items()}
                  for _ in range(DECODE_ROUNDS)]
        for engine in engines.values():
            engine.close()
        theirs = hf.decode_tokens_per_s(prompts, DECODE_TOKENS)
        llama_tok_s = llama.decode_tokens_per_s(prompts[0], DECODE_TOKENS) if llama is not None and b == 1 else None
        for mode in models:
            tok_s = statistics.median(r[mode].tokens_per_s for r in rounds)
            row = {
                "mode": mode,
                "batch": b,
                "kvtierd_tok_s": tok_s,
                "vs_float32": statistics.median(r[mode].tokens_per_s / r["float32"].tokens_per_s for r in rounds),
                "transformers_tok_s": theirs,
                "vs_transformers": tok_s / theirs,
                "llama_cpp_tok_s": llama_tok_s,
                "vs_llama_cpp": None if llama_tok_s is None else tok_s / llama_tok_s,
                "step_overhead_ms": statistics.median(r[mode].step_overhead_ms for r in rounds),
            }
            if b == 1:
                weight_bytes = models[mode].model.weights.num_bytes_per_token()
                row["weight_GB_s"] = weight_bytes * tok_s / 1e9
                row["share_of_mem_bw"] = weight_bytes * tok_s / bandwidth
            decode_rows.append(row)

    engines = {mode: LLMEngine(lm) for mode, lm in models.items()}
    prefill_rows = []
    for n in prefill_lengths:
        prompt = _prompts(loaded, 1, n)[0]
        sides = {mode: (lambda p, e=e: engine_prefill_s(e, p)) for mode, e in engines.items()}
        sides["transformers"] = hf.prefill_s
        if llama is not None:
            sides["llama.cpp"] = llama.prefill_s
        for run in sides.values():
            run(prompt[:16])  # warm-up
        rounds = [{side: run(prompt) for side, run in sides.items()} for _ in range(PREFILL_PAIRS)]
        for side in sides:
            prefill_rows.append({
                "side": side,
                "tokens": n,
                "tok_s": n / statistics.median(r[side] for r in rounds),
                "vs_float32": statistics.median(r["float32"] / r[side] for r in rounds),
            })
    by_session, by_prefix = (warm_turn_ttft_s(engines, loaded, session) for session in (True, False))
    warm = [{"mode": mode, "session_ttft_ms": by_session[mode] * 1e3, "prefix_ttft_ms": by_prefix[mode] * 1e3}
            for mode in engines]
    for e in engines.values():
        e.close()

    overhead = engine_overhead_at(models[modes[-1]], 64)
    return {
        "cpu": cpu_description(),
        "threads": threads,
        "llama_cpp": llama is not None,
        "memory_read_GB_s": bandwidth / 1e9,
        "weight_bytes_per_token": {mode: lm.model.weights.num_bytes_per_token() for mode, lm in models.items()},
        "decode": decode_rows,
        "prefill": prefill_rows,
        "warm_turn": warm,
        "step_overhead_ms_at_64": overhead,
    }


def engine_overhead_at(loaded: LoadedModel, num_seqs: int) -> float:
    """Median per-step time outside the model forward with `num_seqs` decoding."""
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=num_seqs))
    return engine_decode(engine, _prompts(loaded, num_seqs, 32), 16).step_overhead_ms
