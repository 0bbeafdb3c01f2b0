"""`kvtierd bench fleet`: reuse across hosts through the remote tier, vs recomputing.

Two engines in one process stand for two hosts of a fleet: each has its own
device pool and no host or disk tier, and both use one redis-server (started
by the bench on a free loopback port, or given with `--redis-url`), so every
hit on host B below its device came from the remote tier.

- Shared document: host A answers a question over a document; host B then
  answers another question over it (a remote hit) beside a host that computes
  everything (prefix caching off). TTFT, and B's tokens by tier.
- Multi-turn: a session's turns on A, its next turn on B, vs recomputing it.
- Bandwidth: loading the stored chunks through the store (GETEX, HMAC, frame
  checks) beside plain GETs of values of the same size from the same server,
  and SETs, in the same run.

TTFT is engine time (from `add_request` to the first token), medians of the
repeats; the machine is noisy: quote ratios.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from kvtierd.bench.reuse_bench import document, questions, run_request, warm_up
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.model.loader import LoadedModel
from kvtierd.tiers.config import RemoteConfig, TierConfig

REDIS_SERVER = "redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_on_loopback() -> Iterator[str]:
    """A throwaway redis-server (no persistence) on a free loopback port; its URL."""
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        raise RuntimeError("bench fleet needs redis-server (apt-get install redis-server), or --redis-url")
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="kvtierd-bench-redis-")
    process = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly",
                                "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _host(loaded: LoadedModel, url: str, secret: bytes, fleet: str) -> LLMEngine:
    remote = RemoteConfig(url=url, secret=secret, fleet=fleet)
    return LLMEngine(loaded, EngineConfig(tiers=TierConfig(host_bytes=0, disk_bytes=0, remote=remote)))


def _settle(*engines: LLMEngine) -> None:
    for e in engines:
        e.tiers.wait()


def run_fleet_bench(loaded: LoadedModel, redis_url: str | None = None, doc_tokens: int = 2000, repeats: int = 3,
                    turns: int = 3) -> dict:
    if redis_url is None:
        with redis_on_loopback() as url:
            return {"redis": "started by the bench (loopback)", **_run(loaded, url, doc_tokens, repeats, turns)}
    return {"redis": redis_url, **_run(loaded, redis_url, doc_tokens, repeats, turns)}


def _run(loaded: LoadedModel, url: str, doc_tokens: int, repeats: int, turns: int) -> dict:
    secret, fleet = secrets.token_bytes(32), f"bench-{secrets.token_hex(4)}"
    a, b = _host(loaded, url, secret, fleet), _host(loaded, url, secret, fleet)
    cold = LLMEngine(loaded, EngineConfig(enable_prefix_caching=False))
    for e in (a, b, cold):
        warm_up(e)
    tok = loaded.tokenizer
    shared = []
    for r in range(repeats):
        doc = document(tok, doc_tokens, seed=10 + r)
        q1, q2 = questions(2 * repeats)[2 * r : 2 * r + 2]
        tenant = f"doc-{r}"
        run_request(a, tok.encode_chat([{"role": "user", "content": f"{doc}\n\n{q1}"}]), 1, tenant=tenant)
        _settle(a)
        prompt = tok.encode_chat([{"role": "user", "content": f"{doc}\n\n{q2}"}])
        before = b.counters.remote_tokens
        hit = run_request(b, prompt, 1, tenant=tenant)
        recompute = run_request(cold, prompt, 1)
        shared.append({"prompt_tokens": len(prompt), "remote_tokens": b.counters.remote_tokens - before,
                       "cached_tokens": hit.num_cached_tokens, "ttft_remote_ms": hit.ttft_s * 1e3,
                       "ttft_recompute_ms": recompute.ttft_s * 1e3, "speedup": recompute.ttft_s / hit.ttft_s})

    messages = [{"role": "user", "content": document(tok, doc_tokens // 2, seed=99) + "\n\nSummarise."}]
    for t in range(turns):
        reply = run_request(a, tok.encode_chat(messages), 8, tenant="fleet-session", session_id="s").text
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": questions(turns)[t]}]
    _settle(a)
    prompt = tok.encode_chat(messages)
    before = b.counters.remote_tokens
    moved = run_request(b, prompt, 1, tenant="fleet-session", session_id="s")
    recompute = run_request(cold, prompt, 1)
    session = {"turns_on_a": turns, "prompt_tokens": len(prompt), "cached_tokens": moved.num_cached_tokens,
               "remote_tokens": b.counters.remote_tokens - before,
               "ttft_on_b_ms": moved.ttft_s * 1e3, "ttft_recompute_ms": recompute.ttft_s * 1e3,
               "speedup": recompute.ttft_s / moved.ttft_s}
    bandwidth = _bandwidth(b, url)
    for e in (a, b):
        e.close()
    return {"doc_tokens": doc_tokens, "shared_document": shared,
            "shared_speedup_median": statistics.median(r["speedup"] for r in shared),
            "session": session, "bandwidth": bandwidth}


def _bandwidth(engine: LLMEngine, url: str, rounds: int = 3) -> dict:
    """Loads of every chunk the store holds for the bench's fleet, beside raw GETs/SETs of equal size."""
    store = engine.tiers.remote
    raw = redis.Redis.from_url(url)
    names = list(raw.scan_iter(match=f"{store.key_prefix}*".encode()))
    names = [n for n in names if not n.endswith(b"epoch")]
    keys = [bytes.fromhex(n[len(store.key_prefix):].decode()) for n in names]
    sizes = [raw.strlen(n) for n in names]
    total = sum(sizes)
    store_s = min(_timed(lambda: store.get_many(keys)) for _ in range(rounds))
    blobs = [secrets.token_bytes(n) for n in sizes]
    tmp = [f"kvtierd-bench-raw:{i}".encode() for i in range(len(blobs))]

    def raw_set() -> None:
        pipe = raw.pipeline(transaction=False)
        for k, v in zip(tmp, blobs):
            pipe.set(k, v)
        pipe.execute()

    def raw_get() -> None:
        pipe = raw.pipeline(transaction=False)
        for k in tmp:
            pipe.get(k)
        pipe.execute()

    set_s = min(_timed(raw_set) for _ in range(rounds))
    get_s = min(_timed(raw_get) for _ in range(rounds))
    raw.delete(*tmp)
    raw.close()
    return {"chunks": len(keys), "bytes": total, "store_get_GB_s": total / store_s / 1e9,
            "raw_get_GB_s": total / get_s / 1e9, "raw_set_GB_s": total / set_s / 1e9,
            "store_share_of_raw_get": get_s / store_s}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
