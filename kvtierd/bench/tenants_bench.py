"""`kvtierd bench tenants`: a quiet tenant's cache under a noisy tenant's flood, with cache shares on and off.

Through the engine, in one process, on the one loaded model. The quiet tenant reads a few hot documents
(each request: a document and a short new question) and keeps a few chat sessions going (each turn: the
history and a new message); the noisy tenant floods unique long prompts, several times the device pool
in all. They arrive in rounds: each round, `noisy_per_round` flood prompts and one quiet request are
added together and the engine steps until all are done, so the quiet request shares its steps with the
flood's prefill. Runs, each a fresh engine:

    alone        the quiet tenant's requests, no flood: the figures to compare against
    no shares    the flood too; one eviction order for both tenants (LRU)
    shares       the flood too; eviction takes from the tenant above its share first

each once with the host tier off (the device cache alone) and once on (a host slab of `host_pages`,
chunks of 4 pages). Reported for the quiet tenant: prompt tokens served by tier (device, host), its TTFT
p50/p95 (engine time, from the round's start to its first token). Targets with shares: host tier off,
its device hit rate >= 90% of alone; host tier on, device + host >= 95% of alone.

How much of the quiet tenant's TTFT change is the flood's compute rather than the cache: with shares on,
its hits match the run alone, so its TTFT over alone is what sharing steps with the flood's prefill
costs; the TTFT shares off adds over shares on is what the lost cache costs (the prompt recomputed).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from kvtierd.engine.config import EngineConfig, QosConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.model.loader import LoadedModel
from kvtierd.tiers.config import TierConfig

BLOCK_SIZE = 16
CHUNK_PAGES = 4
DEVICE_TARGET = 0.90  # host tier off: quiet device hit rate with shares, over alone
MEMORY_TARGET = 0.95  # host tier on: quiet device + host hit rate with shares, over alone


@dataclass(frozen=True, slots=True)
class TenantsWorkload:
    kv_pages: int = 128  # the device pool, in pages of 16 tokens
    host_pages: int = 128  # the host slab of the host-tier runs, in pages
    docs: int = 2  # the quiet tenant's hot documents
    doc_tokens: int = 256
    sessions: int = 2  # the quiet tenant's chat sessions
    turn_tokens: int = 32  # each turn's new message
    rounds: int = 12  # one quiet request per round (documents and session turns in turn)
    noisy_per_round: int = 3
    noisy_tokens: int = 256  # each flood prompt, unique
    reply_tokens: int = 4

    @property
    def flood_x_pool(self) -> float:
        return self.rounds * self.noisy_per_round * self.noisy_tokens / (self.kv_pages * BLOCK_SIZE)


def _words(loaded: LoadedModel, tag: str, num_tokens: int) -> list[int]:
    """Distinct text of exactly `num_tokens` tokens."""
    ids = loaded.tokenizer.encode(" ".join(f"{tag}-{i}" for i in range(num_tokens)))
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_scenario(loaded: LoadedModel, w: TenantsWorkload, flood: bool, shares: bool, host: bool) -> dict:
    mc = loaded.config
    page_bytes = BLOCK_SIZE * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * loaded.model.kv_dtype.itemsize
    tiers = TierConfig(host_bytes=w.host_pages * page_bytes + (1 << 20), disk_bytes=0, chunk_pages=CHUNK_PAGES) \
        if host else None
    no_limit = {"high": 0.0, "normal": 0.0, "low": 0.0}
    engine = LLMEngine(loaded, EngineConfig(
        block_size=BLOCK_SIZE, kv_cache_bytes=w.kv_pages * page_bytes, max_num_batched_tokens=512, tiers=tiers,
        qos=QosConfig(reserved_share=0.0, max_queue_s=no_limit, cache_shares=shares)))
    params = SamplingParams(max_tokens=w.reply_tokens, temperature=0.0, ignore_eos=True)
    docs = [_words(loaded, f"doc{d}", w.doc_tokens) for d in range(w.docs)]
    history = {s: _words(loaded, f"sess{s}-sys", w.turn_tokens) for s in range(w.sessions)}
    prompt_tokens = hit = 0
    by_tier = {"device": 0, "host": 0}
    ttft: list[float] = []
    noisy = 0
    try:
        for r in range(w.rounds):
            # Documents and sessions in turn: each is asked again after a few rounds of flood.
            kind = r % (w.docs + w.sessions)
            if kind < w.docs:
                prompt, session = docs[kind] + _words(loaded, f"q{r}", 16), None
            else:
                s = kind - w.docs
                prompt, session = history[s] + _words(loaded, f"turn{r}", w.turn_tokens), f"quiet-{s}"
            start = time.perf_counter()
            if flood:
                for _ in range(w.noisy_per_round):
                    engine.add_request(_words(loaded, f"noise{noisy}", w.noisy_tokens), params, tenant="noisy")
                    noisy += 1
            rid = engine.add_request(prompt, params, tenant="quiet", session_id=session)
            reply: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    if o.request_id != rid:
                        continue
                    if not reply:
                        ttft.append((time.perf_counter() - start) * 1e3)
                        prompt_tokens += o.num_prompt_tokens
                        hit += o.num_cached_tokens
                        below = sum(o.cached_tokens_by_tier.get(t, 0) for t in ("host", "disk", "remote"))
                        by_tier["host"] += below
                        by_tier["device"] += o.num_cached_tokens - below
                    reply += o.token_ids
            if session is not None:
                history[kind - w.docs] = prompt + reply
    finally:
        engine.close()
    return {
        "run": "alone" if not flood else ("shares" if shares else "no shares"), "host_tier": host,
        "quiet_prompt_tokens": prompt_tokens, "device_hit_rate": by_tier["device"] / prompt_tokens,
        "host_hit_rate": by_tier["host"] / prompt_tokens, "memory_hit_rate": hit / prompt_tokens,
        "ttft_p50_ms": statistics.median(ttft), "ttft_p95_ms": _percentile(ttft, 0.95),
        "evictions_under_share": engine.cache_shares.num_evictions_under_share,
        "noisy_prompts": noisy,
    }


def run_tenants_bench(loaded: LoadedModel, w: TenantsWorkload) -> dict:
    warm_up = TenantsWorkload(kv_pages=w.kv_pages, rounds=1, noisy_per_round=1, doc_tokens=32, noisy_tokens=32)
    run_scenario(loaded, warm_up, flood=True, shares=True, host=False)  # first-call costs stay out of the figures
    runs = []
    for host in (False, True):
        alone = run_scenario(loaded, w, flood=False, shares=True, host=host)
        for r in (alone, run_scenario(loaded, w, True, False, host), run_scenario(loaded, w, True, True, host)):
            r["device_vs_alone"] = r["device_hit_rate"] / alone["device_hit_rate"] if alone["device_hit_rate"] else 0.0
            r["memory_vs_alone"] = r["memory_hit_rate"] / alone["memory_hit_rate"] if alone["memory_hit_rate"] else 0.0
            r["ttft_p50_over_alone_ms"] = r["ttft_p50_ms"] - alone["ttft_p50_ms"]
            runs.append(r)
    by = {(r["run"], r["host_tier"]): r for r in runs}
    # None: the quiet tenant alone had no hits to keep (too few rounds for a document to come back).
    targets = {
        "device_hits_host_off": by[("shares", False)]["device_vs_alone"] >= DEVICE_TARGET
        if by[("alone", False)]["device_hit_rate"] else None,
        "memory_hits_host_on": by[("shares", True)]["memory_vs_alone"] >= MEMORY_TARGET
        if by[("alone", True)]["memory_hit_rate"] else None,
    }
    # The TTFT change shares off, split: what the flood's compute costs (shares on, hits as alone) and what
    # the lost cache adds on top (shares off over shares on).
    split = {host: {"flood_compute_ms": by[("shares", host)]["ttft_p50_over_alone_ms"],
                    "lost_cache_ms": by[("no shares", host)]["ttft_p50_ms"] - by[("shares", host)]["ttft_p50_ms"]}
             for host in (False, True)}
    return {"workload": {**asdict(w), "flood_x_pool": w.flood_x_pool}, "runs": runs, "targets": targets,
            "device_target": DEVICE_TARGET, "memory_target": MEMORY_TARGET,
            "ttft_split_p50": {"host off": split[False], "host on": split[True]}}
