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
  checks, decode, one copy out) beside plain pipelined GETs of values of the
  same sizes from the same server, and SETs, in alternating rounds of one run.

TTFT is engine time (from `add_request` to the first token), medians of the
repeats; the machine is noisy: quote ratios.
"""

from __future__ import annotations

import functools
import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import redis

from kvtierd.bench.reuse_bench import document, questions, run_request, warm_up
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.model.loader import LoadedModel
from kvtierd.storage.kv_frame import claimed_identity, decode_frame, encode_frame
from kvtierd.tiers.config import LOOKUP_WAIT_SHARE, RemoteConfig, TierConfig
from kvtierd.tiers.transfer import TRANSFER_WORKERS

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


# The bandwidth rows read every chunk of the fleet in one pipeline (100 MB and more): the default op timeout
# (500 ms) is sized for one request's chunks, and a busy machine ran past it (every value then reads as a miss).
OP_TIMEOUT_MS = 60_000


def _host(loaded: LoadedModel, url: str, secret: bytes, fleet: str, lookup_wait_share: float) -> LLMEngine:
    remote = RemoteConfig(url=url, secret=secret, fleet=fleet, op_timeout_ms=OP_TIMEOUT_MS)
    tiers = TierConfig(host_bytes=0, disk_bytes=0, lookup_wait_share=lookup_wait_share, remote=remote)
    return LLMEngine(loaded, EngineConfig(tiers=tiers))


def _settle(*engines: LLMEngine) -> None:
    for e in engines:
        e.tiers.wait()


def run_fleet_bench(loaded: LoadedModel, redis_url: str | None = None, doc_tokens: int = 2000, repeats: int = 3,
                    turns: int = 3, lookup_wait_share: float = LOOKUP_WAIT_SHARE) -> dict:
    """`lookup_wait_share`: the hosts' `[tiers] lookup_wait_share` (tests raise it: a busy machine answered a
    lookup past a short prompt's share, and host B recomputed what the test checks it loads)."""
    if redis_url is None:
        with redis_on_loopback() as url:
            return {"redis": "started by the bench (loopback)",
                    **_run(loaded, url, doc_tokens, repeats, turns, lookup_wait_share)}
    return {"redis": redis_url, **_run(loaded, redis_url, doc_tokens, repeats, turns, lookup_wait_share)}


def _run(loaded: LoadedModel, url: str, doc_tokens: int, repeats: int, turns: int, lookup_wait_share: float) -> dict:
    secret, fleet = secrets.token_bytes(32), f"bench-{secrets.token_hex(4)}"
    a, b = (_host(loaded, url, secret, fleet, lookup_wait_share) for _ in range(2))
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


def _bandwidth(engine: LLMEngine, url: str, rounds: int = 5) -> dict:
    """Every chunk the store holds for the bench's fleet, read back in alternating rounds: raw pipelined GETs
    of values of the same sizes (what the server and the socket give), the store's pipelined get_many
    (GETEX and HMAC), and whole loads as the engine's transfer workers run them (a chunk's get, HMAC, frame
    checks and decode, then one copy into a destination buffer; TRANSFER_WORKERS chunks at a time), of the
    chunks as stored (the tier's codec) and of the same chunks stored raw. GB/s are of KV payload, the
    decoded bytes a load delivers, so the rows compare; medians of the rounds."""
    store = engine.tiers.remote
    raw = redis.Redis.from_url(url)
    names = [n for n in raw.scan_iter(match=f"{store.key_prefix}*".encode()) if not n.endswith(b"epoch")]
    keys = [bytes.fromhex(n[len(store.key_prefix):].decode()) for n in names]
    sizes = [raw.strlen(n) for n in names]
    frames = _all_read(store.get_many(keys))
    identities = [claimed_identity(f, engine.geometry) for f in frames]
    codec = {decode_frame(f, i).codec for f, i in zip(frames, identities)}
    raw_keys = [k + b"/raw" for k in keys]  # the same chunks under keys of their own, stored raw
    store.put_many([(k, encode_frame(i, decode_frame(f, i).payload, codec="raw"))
                    for k, f, i in zip(raw_keys, frames, identities)])
    del frames
    payload = sum(i.payload_nbytes for i in identities)
    outs = [np.empty(i.payload_nbytes, np.uint8) for i in identities]
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

    def load(chunk_keys: list[bytes], i: int) -> None:
        [frame] = _all_read(store.get_many([chunk_keys[i]]))
        np.copyto(outs[i], np.frombuffer(decode_frame(frame, identities[i]).payload, np.uint8))

    with ThreadPoolExecutor(TRANSFER_WORKERS) as workers:
        runs = {"raw_set": raw_set, "raw_get": raw_get, "store_get": lambda: _all_read(store.get_many(keys)),
                "store_load": lambda: list(workers.map(functools.partial(load, keys), range(len(keys)))),
                "store_load_raw": lambda: list(workers.map(functools.partial(load, raw_keys), range(len(keys))))}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                times[name].append(_timed(fn))
    raw.delete(*tmp)
    raw.close()
    store.delete_many(raw_keys)
    gbs = {name: payload / statistics.median(t) / 1e9 for name, t in times.items()}
    return {"chunks": len(keys), "codec": "/".join(sorted(codec)), "payload_bytes": payload,
            "stored_bytes": sum(sizes), "rounds": rounds, "workers": TRANSFER_WORKERS,
            "store_load_GB_s": gbs["store_load"], "store_load_raw_codec_GB_s": gbs["store_load_raw"],
            "store_get_GB_s": gbs["store_get"], "raw_get_GB_s": gbs["raw_get"], "raw_set_GB_s": gbs["raw_set"],
            "store_load_share_of_raw_get": gbs["store_load"] / gbs["raw_get"]}


def _all_read(frames: list) -> list:
    """The frames, every one of them read: a miss here is a Redis gone or too slow, not a figure."""
    if any(f is None for f in frames):
        raise RuntimeError(f"the remote tier answered {sum(f is None for f in frames)} of {len(frames)} chunks "
                           "with nothing (see the log: a timeout or a dropped value)")
    return frames


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
