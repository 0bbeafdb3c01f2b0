"""`kvtierd bench reuse`: what the prefix index saves, index on and off in one process.

- Multi-turn: a chat over one document, each turn's prompt the whole rendered
  history (earlier replies included), sent as one session: TTFT per turn with
  the session's context pool (and the prefix index) vs an engine that computes
  every prompt (`EngineConfig(enable_prefix_caching=False)`), on identical
  prompts: the replies come from the cached run. The two sides are interleaved
  turn by turn, so machine noise hits both alike.
- Shared document: many questions over one document; prefill tokens computed
  (prompt tokens minus cached tokens) and wall time, index on and off.
  Submitted all at once, a request admitted before the document's pages are
  computed finds no hit and computes them itself (the no-hit count); sent in
  turn, only the first misses.
- Lookup cost: hashing a prompt's full pages and `find_prefix` on a fully
  cached prompt, beside the TTFT of a request that hits that cache.

TTFT is engine time: from `add_request` to the step that returns the request's
first token, with the engine stepped synchronously and nothing else running.

The command runs torch on the daemon's thread count (torch's default, one per
core) unless `--threads` says otherwise, so recomputing gets the cores a real
daemon would give it. On a busy shared machine that makes small steps wait for
a core another process holds: run it alone, or compare `--threads 1` beside it.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from kvtierd.cache.block_hash import hash_full_blocks, namespace_root
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import LoadedModel
from kvtierd.model.tokenizer import ChatTokenizer

REPLY_TOKENS = 16  # greedy reply length of each multi-turn turn
TTFT_TARGET = 20.0  # turns 2.. at least this many times faster than recompute
PREFILL_TARGET = 10.0  # shared document: at least this many times fewer prefill tokens
LOOKUP_SHARE_TARGET = 0.01  # find_prefix under this share of a hit's TTFT

_COMPONENTS = ("block pool", "scheduler", "page table", "prefix index", "model runner", "sampler",
               "detokenizer", "session store", "device pool", "tier manager", "admission queue", "socket server")
_VERBS = ("allocates", "releases", "hashes", "indexes", "evicts", "copies", "validates", "schedules",
          "records", "streams", "batches", "preempts")
_OBJECTS = ("full pages", "partial pages", "token chunks", "chained hashes", "request slots", "decode steps",
            "prefill chunks", "reference counts", "cached prefixes", "session turns", "KV tensors", "stop strings")
_WHEN = ("before each step", "after the forward pass", "when pages run out", "on admission",
         "once a request finishes", "under memory pressure", "when a client disconnects", "at startup")
_EVENTS = ("pages run out", "a request is preempted", "a client disconnects", "a prefix hits the cache",
           "a session resumes", "the daemon drains")
_FOLLOW_UPS = (
    "Summarize the previous answer in five words.",
    "Which component evicts pages first?",
    "What happens when pages run out?",
    "Name one counter the document mentions.",
    "Is the prefix index shared between tenants?",
    "What does section 2 describe?",
    "Give one number from the document.",
    "Which step runs after the forward pass?",
    "What is copied on write?",
    "Answer yes or no: are partial pages indexed?",
)


def document(tokenizer: ChatTokenizer, num_tokens: int, seed: int = 0) -> str:
    """A deterministic synthetic design document of about `num_tokens` tokens (whole sentences)."""
    rng = random.Random(seed)
    parts: list[str] = []
    total, section = 0, 0
    while total < num_tokens:
        if section == 0 or rng.random() < 0.12:
            section += 1
            part = f"\n\n## {section}. The {rng.choice(_COMPONENTS)}\n\n"
        else:
            part = (
                f"The {rng.choice(_COMPONENTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_WHEN)}, "
                f"keeping {rng.randint(2, 4096)} {rng.choice(_OBJECTS)} within a budget of "
                f"{rng.randint(1, 64)} MiB. "
            )
        parts.append(part)
        total += len(tokenizer.encode(part))
    return "".join(parts).strip()


def questions(n: int) -> list[str]:
    """n distinct short questions about the document."""
    pairs = [(c, e) for e in _EVENTS for c in _COMPONENTS]
    return [f"What does the {c} do when {e}?" for c, e in (pairs * (n // len(pairs) + 1))[:n]]


def follow_up(turn: int) -> str:
    return _FOLLOW_UPS[turn % len(_FOLLOW_UPS)]


@dataclass(slots=True)
class FirstToken:
    ttft_s: float
    num_prompt_tokens: int
    num_cached_tokens: int
    cache_source: str
    token_ids: list[int]  # every output token
    text: str


def run_request(engine: LLMEngine, prompt: list[int], max_tokens: int, tenant: str = "",
                session_id: str | None = None) -> FirstToken:
    """Runs one request alone to completion; times its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params, tenant=tenant, session_id=session_id)
    ttft, cached, source, ids, text = None, 0, "none", [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if ttft is None:
                ttft, cached, source = time.perf_counter() - t0, o.num_cached_tokens, o.cache_source
            ids += o.token_ids
            text.append(o.text)
    assert ttft is not None, f"request {rid} produced no token"
    return FirstToken(ttft, len(prompt), cached, source, ids, "".join(text))


def warm_up(engine: LLMEngine) -> None:
    """A short request, twice, in its own namespace: first-call costs of both attention
    paths (a cold prompt, and new tokens after a cached prefix) stay out of the figures."""
    prompt = engine.loaded.tokenizer.encode("Warm-up: " + "the cache " * 40)
    for _ in range(2):
        run_request(engine, prompt, 2, tenant="warm-up")


# -- multi-turn ---------------------------------------------------------------


def run_multi_turn(loaded: LoadedModel, turns: int, doc_tokens: int, reply_tokens: int = REPLY_TOKENS) -> dict:
    tok = loaded.tokenizer
    cached_engine = LLMEngine(loaded)
    recompute_engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False))
    warm_up(cached_engine)
    warm_up(recompute_engine)
    messages = [{"role": "user", "content": document(tok, doc_tokens) + "\n\n" + questions(1)[0]}]
    rows = []
    for t in range(turns):
        prompt = tok.encode_chat(messages)
        hit = run_request(cached_engine, prompt, reply_tokens, session_id="bench")
        cold = run_request(recompute_engine, prompt, 1)  # TTFT only: the reply comes from the cached run
        assert cold.num_cached_tokens == 0, "the recompute engine served a cached prefix"
        rows.append({
            "turn": t + 1,
            "prompt_tokens": len(prompt),
            "cached_tokens": hit.num_cached_tokens,
            "source": hit.cache_source,
            "ttft_cached_ms": hit.ttft_s * 1e3,
            "ttft_recompute_ms": cold.ttft_s * 1e3,
            "speedup": cold.ttft_s / hit.ttft_s,
        })
        messages += [{"role": "assistant", "content": hit.text}, {"role": "user", "content": follow_up(t)}]
    later = [r["speedup"] for r in rows[1:]]
    return {
        "turns": turns,
        "doc_tokens": doc_tokens,
        "reply_tokens": reply_tokens,
        "rows": rows,
        "speedup_later_turns_median": statistics.median(later) if later else None,
        "speedup_later_turns_min": min(later) if later else None,
        "target": TTFT_TARGET,
    }


# -- shared document -----------------------------------------------------------


def run_shared_document(loaded: LoadedModel, num_requests: int, doc_tokens: int) -> dict:
    """Every prompt is the document plus its own question; max_tokens 1, so wall time is prefill."""
    tok = loaded.tokenizer
    doc = document(tok, doc_tokens, seed=1)
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]) for q in questions(num_requests)
    ]
    runs = [
        _shared_run(loaded, prompts, prefix_caching=False, concurrent=True),
        _shared_run(loaded, prompts, prefix_caching=True, concurrent=True),
        _shared_run(loaded, prompts, prefix_caching=True, concurrent=False),
    ]
    baseline = runs[0]["prefill_tokens_computed"]
    for r in runs:
        r["fewer_prefill_x"] = baseline / r["prefill_tokens_computed"]
        r["wall_speedup"] = runs[0]["wall_s"] / r["wall_s"]
    return {"requests": num_requests, "doc_tokens": doc_tokens, "runs": runs, "target": PREFILL_TARGET}


def _shared_run(loaded: LoadedModel, prompts: list[list[int]], prefix_caching: bool, concurrent: bool) -> dict:
    engine = LLMEngine(loaded, EngineConfig(enable_prefix_caching=prefix_caching))
    warm_up(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    forward_tokens = 0
    cached: dict[str, int] = {}
    t0 = time.perf_counter()
    pending = [list(prompts)] if concurrent else [[p] for p in prompts]
    for batch in pending:
        for p in batch:
            engine.add_request(p, params)
        while engine.has_unfinished():
            last = engine.last_step
            for o in engine.step():
                cached.setdefault(o.request_id, o.num_cached_tokens)
            if engine.last_step is not last:  # an empty plan leaves last_step as it was
                forward_tokens += engine.last_step.num_tokens
    wall = time.perf_counter() - t0
    prompt_tokens = sum(map(len, prompts))
    cached_tokens = sum(cached.values())
    return {
        "submission": "at once" if concurrent else "in turn",
        "prefix_index": prefix_caching,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "prefill_tokens_computed": prompt_tokens - cached_tokens,
        "forward_tokens": forward_tokens,  # tokens through the model: equals the above unless preempted
        "requests_without_hit": sum(c == 0 for c in cached.values()),
        "wall_s": wall,
    }


# -- hashing and lookup ---------------------------------------------------------


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def run_lookup_cost(loaded: LoadedModel, num_tokens: int = 1000, repeats: int = 2000, hit_repeats: int = 5) -> dict:
    """Hashing and find_prefix on a fully cached `num_tokens` prompt, beside that prompt's hit TTFT."""
    engine = LLMEngine(loaded)
    warm_up(engine)
    bs = engine.config.block_size
    prompt = loaded.tokenizer.encode(document(loaded.tokenizer, num_tokens + 64, seed=2))[:num_tokens]
    root = namespace_root(loaded.fingerprint, "")
    cold = run_request(engine, prompt, 1)
    hits = [run_request(engine, prompt, 1) for _ in range(hit_repeats)]
    expected = min(len(prompt) // bs * bs, len(prompt) - 1)  # its whole pages, less the token left to compute
    assert all(h.num_cached_tokens == expected for h in hits), "the repeated prompt did not hit its cached pages"
    assert engine.kv.find_prefix(root, prompt).num_tokens == expected
    hash_us = _median_us(lambda: hash_full_blocks(root, prompt, bs), repeats)
    lookup_us = _median_us(lambda: engine.kv.find_prefix(root, prompt), repeats)
    hit_ttft_s = statistics.median(h.ttft_s for h in hits)
    return {
        "tokens": len(prompt),
        "block_size": bs,
        "hash_us": hash_us,
        "lookup_us": lookup_us,  # hashing included: find_prefix hashes the prompt first
        "cold_ttft_ms": cold.ttft_s * 1e3,
        "hit_ttft_ms": hit_ttft_s * 1e3,
        "cached_tokens": expected,
        "lookup_share_of_hit_ttft": lookup_us / 1e6 / hit_ttft_s,
        "target_share": LOOKUP_SHARE_TARGET,
    }


def run_reuse_bench(
    loaded: LoadedModel,
    turns: int = 8,
    turn_doc_tokens: int = 1500,
    shared_doc_tokens: int = 2000,
    num_requests: int = 16,
    lookup_tokens: int = 1000,
) -> dict:
    return {
        "multi_turn": run_multi_turn(loaded, turns, turn_doc_tokens),
        "shared_document": run_shared_document(loaded, num_requests, shared_doc_tokens),
        "lookup": run_lookup_cost(loaded, lookup_tokens),
    }
