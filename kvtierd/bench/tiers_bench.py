"""`kvtierd bench tiers`: the host, disk and remote tiers against recomputing, in one process.

- Next turn: a session's `restore_tokens` prompt was computed; its next turn (the
  same tokens and a short question) arrives when the prompt's KV is no longer on
  the device, only in one tier: host, disk (warm: data.mdb in the OS page cache,
  as written; cold: its pages dropped before each turn) or remote (a real
  redis-server started by the bench, when `redis-server` is on PATH). The figure
  is the turn's time to first token through the engine (`add_request` to its
  first token: lookup, load, the prefill of the tokens left, the first decode),
  each repetition on a fresh engine whose device holds nothing, beside the TTFT
  of the same turn recomputed from scratch. The sources take turns within each
  repetition, so drift in the machine's speed weighs on all alike. Each restored
  turn's first token is checked against the recomputed one's.
- Through the daemon: the same comparison as a user sees it, over the socket
  with streaming: a stored session's first turn, a SIGTERM and a restart (the
  session's pages are flushed to disk and warmed back into the host tier), then
  its next turn, beside the same next turn as a fresh tenant's request.
- Disk bandwidth: chunks of real KV written through the disk tier's writer
  (`ChunkWriter`: encode, one fsynced LMDB transaction per chunk) and read
  back as a load reads them (`DiskStore.get_many` of one chunk, frame checks,
  decode), beside a plain file of the same bytes in the same directory,
  written sequentially with one fsync and read back cold.
- Codecs: ratio and speed of every codec on chunks of real KV.
- Working set: sessions whose KV is several times the device pool, one short
  turn each in round robin; TTFT and where the prompt tokens came from, with
  the host and disk tiers and device-only, on the same prompts (the replies
  come from the tiered run). The rounds after the first are measured. Each
  turn's background disk writes are waited for before the next turn, and that
  wait is reported beside the run's wall time, so their cost is in the table.
  The default budgets keep the daemon's ratio (host tier 2 GiB for a 1 GiB
  device pool). Round robin over more sessions than the device and host hold
  is LRU's worst case: a session's chunks leave the host before its next turn,
  and its KV comes back from disk.

Cold reads: POSIX_FADV_DONTNEED leaves alone the pages a process has mapped,
and LMDB maps data.mdb, so a cold read closes the store, drops the file's
pages and opens it again (outside the timing), as after a restart.
Times are wall time, with torch on the daemon's thread count (torch's default) unless `--threads` says
otherwise; quote medians and ratios.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtierd.bench.fleet_bench import REDIS_SERVER, redis_on_loopback
from kvtierd.bench.report import median_time
from kvtierd.bench.reuse_bench import FirstToken, document, follow_up, questions, run_request, warm_up
from kvtierd.cache.block_hash import namespace_root
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.model.loader import LoadedModel
from kvtierd.storage.codecs import CODEC_NAMES, get_codec
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import ChunkIdentity, decode_frame
from kvtierd.tiers.chunk import ChunkCopy, ChunkSpan, spans_of
from kvtierd.tiers.chunk_writer import ChunkWriter
from kvtierd.tiers.config import LOOKUP_WAIT_SHARE, RemoteConfig, TierConfig, resolve_codec
from kvtierd.tiers.tier_manager import TierManager

RESTORE_SOURCES = ("device", "host", "disk warm", "disk cold", "remote")
# The targets for the next turn: host <= 1.3x a device hit; disk cold <= a device hit + 1.5x a plain
# file's cold read of the same bytes.
HOST_TARGET_X = 1.3
DISK_TARGET_READS = 1.5
NEXT_QUESTION = "\n\nQuestion: which component evicts pages first, and when?"
TARGET_SHARE_OF_RAW = 0.5  # the disk tier's bandwidth at least this share of the raw disk's
GB = 1e9
MIN_MAP_BYTES = 1 << 30  # LMDB maps grow sparsely: room is free until used
SLOT_SLACK = 1 << 16  # a host slot's frame header and token ids, beyond the KV
TURN_TOKENS = 32  # the most a follow-up question adds to a prompt, with the chat template's turn markers
BLOCK_SIZE = EngineConfig().block_size  # every engine and device pool here uses the default page size


@dataclass(frozen=True, slots=True)
class TiersWorkload:
    restore_tokens: int = 2000  # the session restored
    restore_repeats: int = 5  # next turns per tier, each on a fresh engine
    recompute_repeats: int = 3  # a prefill of restore_tokens takes seconds on CPU
    daemon: bool = True  # the restart row through a daemon's socket (a daemon of its own: seconds to start)
    chunk_pages: int = 16  # pages per stored chunk (the tiers' default)
    bandwidth_chunks: int = 32  # chunks written to disk and read back, per codec
    codec_repeats: int = 3
    sessions: int = 16
    history_tokens: int = 384  # each session's first prompt: a document and a question
    rounds: int = 3  # turns per session; the first builds the histories (and warms up) and is not measured
    reply_tokens: int = 8
    device_share: float = 0.25  # of the sessions' first prompts' KV, what the device pool holds (at least a session)
    host_share: float = 0.5  # ... and the host tier (the disk tier holds all)

    def __post_init__(self) -> None:
        counts = (self.restore_repeats, self.recompute_repeats, self.chunk_pages, self.bandwidth_chunks,
                  self.codec_repeats, self.sessions, self.history_tokens, self.reply_tokens)
        if min(counts) < 1 or self.rounds < 2:
            raise ValueError("counts must be at least 1, and rounds at least 2 (the first is not measured)")
        if self.restore_tokens <= self.chunk_pages * BLOCK_SIZE:
            raise ValueError(f"restore_tokens must cover a whole chunk ({self.chunk_pages} pages of {BLOCK_SIZE} "
                             "tokens) and one token more")
        if not 0 < self.device_share <= 1 or self.host_share <= 0:
            raise ValueError("device_share must be in (0, 1] and host_share positive")


@dataclass(frozen=True, slots=True)
class RestoreRow:
    source: str  # "device" (a hit), "host", "disk warm" (page cache), "disk cold" (pages dropped) or "remote"
    ttft_ms: float | None  # median TTFT of the next turn (None: skipped)
    speedup: float | None  # recompute TTFT / this
    loaded_tokens: int  # prompt tokens loaded from the tier, the fewest over the repetitions
    computed_tokens: int  # prompt tokens computed, the most over the repetitions
    same_first_token: bool  # every repetition's first token is the recomputed turn's
    skipped: str = ""  # why the row did not run


@dataclass(frozen=True, slots=True)
class DaemonRestoreRow:
    """The next turn of a stored session after a daemon restart, over the socket, beside a fresh tenant's."""

    prompt_tokens: int
    ttft_restored_ms: float  # client-side: request sent to the first streamed content chunk
    ttft_recompute_ms: float
    speedup: float
    cached_by_tier: dict[str, int]  # the restored turn's prompt tokens by the tier they came from
    same_reply: bool  # both turns' greedy replies are equal


@dataclass(frozen=True, slots=True)
class RestoreFigures:
    prompt_tokens: int  # the stored turn
    next_turn_tokens: int  # the next turn's prompt: the stored turn and a question
    stored_tokens: int  # its full pages but the one holding the last token
    kv_bytes: int
    chunks: int
    repeats: int
    recompute_ms: float  # median TTFT of the next turn, computed from scratch
    raw_read_ms: float  # a plain file of the KV's bytes in the disk tier's directory, read cold
    rows: list[RestoreRow]
    daemon: DaemonRestoreRow | None
    daemon_skipped: str = ""


@dataclass(frozen=True, slots=True)
class DiskBandwidthRow:
    codec: str
    stored_bytes: int  # the frames in LMDB
    write_GB_s: float  # GB of KV payload per second, committed
    read_cold_GB_s: float
    read_warm_GB_s: float
    write_share_of_raw: float
    read_share_of_raw: float  # cold against cold
    payload_equal: bool  # every chunk read back decoded to the KV written


@dataclass(frozen=True, slots=True)
class DiskBandwidthFigures:
    directory: str
    chunks: int
    payload_bytes: int
    raw_write_GB_s: float  # a plain file, sequential, one fsync
    raw_read_cold_GB_s: float
    target_share: float
    auto_codec: str  # what the default disk codec ("auto") picks for this KV
    rows: list[DiskBandwidthRow]


@dataclass(frozen=True, slots=True)
class CodecRow:
    codec: str
    dtype: str  # the KV's dtype: the model's, and bfloat16 as a GPU host keeps it
    ratio: float  # payload / encoded
    compress_GB_s: float  # of payload, median
    decompress_GB_s: float
    exact: bool  # decode(encode(x)) == x on every chunk


@dataclass(frozen=True, slots=True)
class CodecFigures:
    dtype: str
    chunks: int
    payload_bytes: int
    rows: list[CodecRow]


@dataclass(frozen=True, slots=True)
class WorkingSetRun:
    run: str  # "tiers" or "device only"
    requests: int  # measured: the rounds after the first
    prompt_tokens: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    share_by_tier: dict[str, float]  # of the prompt tokens: device, host, disk, computed
    wall_s: float  # the measured rounds: every turn to its end, and its background writes
    write_wait_s: float  # of which waiting for the turns' background disk writes to land


@dataclass(frozen=True, slots=True)
class WorkingSetFigures:
    sessions: int
    rounds: int
    working_set_tokens: int  # the sessions' first prompts
    device_pages: int
    host_slots: int  # chunks the host tier holds (a partial chunk takes a slot too)
    block_size: int
    chunk_pages: int
    runs: list[WorkingSetRun]
    ttft_p50_speedup: float  # device only / tiers


@dataclass(frozen=True, slots=True)
class TiersFigures:
    workload: TiersWorkload
    restore: RestoreFigures
    disk_bandwidth: DiskBandwidthFigures
    codecs: CodecFigures
    working_set: WorkingSetFigures


@dataclass(frozen=True, slots=True)
class ComputedPrompt:
    """A prompt prefilled by the model, the KV of its restorable pages, and its next turn."""

    tenant: str  # whose namespace its pages were hashed in
    root: bytes
    token_ids: list[int]
    next_turn: list[int]  # token_ids and a question
    block_hashes: list[bytes]  # of its full pages but the one holding the last token
    kv: torch.Tensor  # [layers, 2, pages, block_size, kv_heads, head_dim], CPU
    geometry: KVGeometry
    recompute: list[FirstToken]  # the next turn computed from scratch, each in a fresh namespace

    @property
    def recompute_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.recompute)

    def spans(self, chunk_pages: int) -> list[ChunkSpan]:
        return spans_of(self.root, self.block_hashes, self.token_ids, self.geometry.block_size, chunk_pages)

    def copies(self, chunk_pages: int) -> list[ChunkCopy]:
        """Each chunk, as held in the first pages of a device pool (see `_fill`)."""
        return [ChunkCopy(s, tuple(range(s.first_page, s.first_page + s.num_pages))) for s in self.spans(chunk_pages)]

    def whole_chunks(self, chunk_pages: int) -> list[tuple[ChunkSpan, torch.Tensor]]:
        """Each whole chunk's span and KV (contiguous, in the tier's layout)."""
        return [(s, self.kv[:, :, s.first_page : s.first_page + s.num_pages].contiguous())
                for s in self.spans(chunk_pages) if s.num_pages == chunk_pages]


def run_tiers_bench(loaded: LoadedModel, w: TiersWorkload, directory: Path | None = None,
                    lookup_wait_share: float = LOOKUP_WAIT_SHARE) -> TiersFigures:
    """Every part, with LMDB stores and files in a temporary directory under `directory` (default: the
    system's temp dir): put it on the disk to measure. `lookup_wait_share`: the engines' `[tiers]
    lookup_wait_share` (tests raise it: a busy machine answers a short prompt's lookup past its share, and the
    turn recomputes what the test checks it loads)."""
    computed = compute_prompt(loaded, w.restore_tokens, w.recompute_repeats)
    with tempfile.TemporaryDirectory(prefix="kvtierd-bench-tiers-", dir=directory) as tmp:
        root = Path(tmp)
        return TiersFigures(
            workload=w,
            restore=run_restore(loaded, computed, w, root / "restore", lookup_wait_share),
            disk_bandwidth=run_disk_bandwidth(computed, w, root / "bandwidth"),
            codecs=run_codecs(computed, w),
            working_set=run_working_set(loaded, w, root / "working-set", lookup_wait_share),
        )


# -- the prompt and its KV ---------------------------------------------------------------------


def compute_prompt(loaded: LoadedModel, num_tokens: int, repeats: int) -> ComputedPrompt:
    """Computes the next turn of a `num_tokens` prompt from scratch `repeats` times (timed), and copies out the
    KV of the prompt's pages."""
    tok = loaded.tokenizer
    prompt = tok.encode(document(tok, num_tokens + 64, seed=3))[:num_tokens]
    next_turn = prompt + tok.encode(NEXT_QUESTION)
    engine = LLMEngine(loaded)
    warm_up(engine)
    tenants = [f"recompute-{i}" for i in range(repeats)]  # each its own namespace: nothing cached by the one before
    recompute = [run_request(engine, next_turn, 1, tenant=t) for t in tenants]
    root = namespace_root(loaded.fingerprint, tenants[-1], engine.config.hash_algorithm)
    hit = engine.kv.find_prefix(root, prompt)  # the last repetition's pages, still cached
    pages = (len(prompt) - 1) // BLOCK_SIZE  # its full pages but the one holding its last token
    assert len(hit.block_hashes) == pages, "the prefilled prompt's pages are gone"
    return ComputedPrompt(tenants[-1], root, prompt, next_turn, list(hit.block_hashes),
                          _gather(engine.pool, hit.block_ids[:pages]), engine.geometry, recompute)


# -- the next turn, restored from each tier ------------------------------------------------------


def run_restore(loaded: LoadedModel, c: ComputedPrompt, w: TiersWorkload, directory: Path,
                lookup_wait_share: float) -> RestoreFigures:
    """The next turn's TTFT with the prompt's KV in one tier only, each repetition on a fresh engine. The
    sources take turns within each repetition (device, host, disk warm, disk cold, remote, then again), so
    a machine whose speed drifts between minutes weighs on each of them alike."""
    spans = c.spans(w.chunk_pages)
    chunk_bytes = w.chunk_pages * c.geometry.bytes_per_block
    device_bytes = 2 * (len(c.next_turn) // BLOCK_SIZE + 2) * c.geometry.bytes_per_block  # the turn, and room
    host = TierConfig(host_bytes=len(spans) * (chunk_bytes + SLOT_SLACK), disk_bytes=0, chunk_pages=w.chunk_pages,
                      lookup_wait_share=lookup_wait_share)

    def host_engine() -> LLMEngine:
        engine = _engine(loaded, device_bytes, host)
        _fill(engine.pool, c.kv)
        engine.tiers.demote(c.copies(w.chunk_pages))  # as if evicted from the device: to the host
        engine.tiers.wait()
        _zero(engine.pool)  # a page the turn did not load cannot pass for one it did
        return engine

    def device_engine() -> LLMEngine:
        """The stored pages on the device, as right after the session's turn: a request of the stored tokens
        and one more loads them (its own last page stays partial, so it is not indexed)."""
        engine = host_engine()
        run_request(engine, c.next_turn[: len(c.block_hashes) * BLOCK_SIZE + 1], 1, tenant=c.tenant)
        return engine

    directory.mkdir()
    disk = TierConfig(host_bytes=0, disk_bytes=max(MIN_MAP_BYTES, 4 * c.kv.nbytes), disk_path=directory,
                      chunk_pages=w.chunk_pages, lookup_wait_share=lookup_wait_share)
    _seed(loaded, c, disk, w.chunk_pages)  # as a session's finished turn: to disk only

    def disk_cold_engine() -> LLMEngine:
        _drop_page_cache(directory / "data.mdb")  # no engine has it open
        return _engine(loaded, device_bytes, disk)  # the same epoch file: the same keys

    with ExitStack() as stack:
        sources = {"device": device_engine, "host": host_engine,
                   "disk warm": lambda: _engine(loaded, device_bytes, disk), "disk cold": disk_cold_engine}
        no_remote = ""
        if shutil.which(REDIS_SERVER) is None:
            no_remote = "no redis-server on PATH"
        else:
            remote = RemoteConfig(url=stack.enter_context(redis_on_loopback()), secret=secrets.token_bytes(32),
                                  fleet=f"bench-{secrets.token_hex(4)}")
            fleet = TierConfig(host_bytes=0, disk_bytes=0, chunk_pages=w.chunk_pages,
                               lookup_wait_share=lookup_wait_share, remote=remote)
            _seed(loaded, c, fleet, w.chunk_pages)  # a session's turn another host of the fleet computed
            sources["remote"] = lambda: _engine(loaded, device_bytes, fleet)
        turns: dict[str, list[_Turn]] = {name: [] for name in sources}
        for _ in range(w.restore_repeats):
            for name, engine in sources.items():
                turns[name].append(_next_turn(engine(), c))
    rows = [_restore_row(name, t, c) for name, t in turns.items()]
    if no_remote:
        rows.append(RestoreRow("remote", None, None, 0, 0, False, skipped=no_remote))
    _, raw_read_s = _raw_file(directory / "raw.bin", [c.kv])

    daemon, why = None, ""
    if not w.daemon:
        why = "not asked for"
    else:
        from kvtierd.bench.daemon_restore import run_daemon_restore

        daemon = run_daemon_restore(loaded.tokenizer, w.restore_tokens)
    return RestoreFigures(len(c.token_ids), len(c.next_turn), len(c.block_hashes) * BLOCK_SIZE, c.kv.nbytes,
                          len(spans), w.restore_repeats, c.recompute_s * 1e3, raw_read_s * 1e3, rows, daemon, why)


def _engine(loaded: LoadedModel, device_bytes: int, tiers: TierConfig) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=device_bytes, tiers=tiers))
    warm_up(engine)  # in a namespace of its own: first-call costs stay out of the figure
    engine.tiers.wait()
    return engine


def _seed(loaded: LoadedModel, c: ComputedPrompt, config: TierConfig, chunk_pages: int) -> None:
    """Stores the prompt's chunks the way a session's finished turn is stored: written through to disk and
    the fleet."""
    pool = DeviceKVPool(c.geometry, c.kv.shape[2], loaded.model.device)
    _fill(pool, c.kv)
    tiers = TierManager(config, pool, loaded.fingerprint)
    tiers.write_turn(c.copies(chunk_pages), session=True)
    tiers.wait()
    tiers.close()


@dataclass(frozen=True, slots=True)
class _Turn:
    out: FirstToken
    by_tier: dict[str, int]


def _next_turn(engine: LLMEngine, c: ComputedPrompt) -> _Turn:
    """The next turn on an engine whose device holds none of the prompt; closes the engine."""
    try:
        before = _served(engine) | {"remote": engine.counters.remote_tokens}
        out = run_request(engine, c.next_turn, 1, tenant=c.tenant)
        after = _served(engine) | {"remote": engine.counters.remote_tokens}
        return _Turn(out, {t: after[t] - before[t] for t in after if after[t] > before[t]})
    finally:
        engine.close()


def _restore_row(source: str, turns: list[_Turn], c: ComputedPrompt) -> RestoreRow:
    ttft = statistics.median(t.out.ttft_s for t in turns)
    tier = source.split()[0]
    first = c.recompute[0].token_ids[:1]
    return RestoreRow(source, ttft * 1e3, c.recompute_s / ttft, min(t.by_tier.get(tier, 0) for t in turns),
                      max(len(c.next_turn) - t.out.num_cached_tokens for t in turns),
                      all(t.out.token_ids[:1] == first for t in turns))


# -- disk bandwidth ------------------------------------------------------------------------------


def run_disk_bandwidth(c: ComputedPrompt, w: TiersWorkload, directory: Path) -> DiskBandwidthFigures:
    chunks = c.whole_chunks(w.chunk_pages)
    items = []  # (key, identity, kv): distinct chunks (their own hashes), the KV cycling through the real chunks
    for i in range(w.bandwidth_chunks):
        span, kv = chunks[i % len(chunks)]
        hashes = tuple(hashlib.md5(f"{i}:{p}".encode()).digest() for p in range(span.num_pages))
        items.append((hashes[-1], ChunkIdentity(c.geometry, span.namespace, hashes, span.token_ids), kv))
    payload = sum(kv.nbytes for _, _, kv in items)
    directory.mkdir()
    raw_write_s, raw_read_s = _raw_file(directory / "raw.bin", [kv for _, _, kv in items])
    rows = []
    for codec in ("zstd-planes", "raw"):  # the smaller one, and what "auto" picks
        path = directory / codec
        path.mkdir()
        write_s, cold_s, warm_s, stored, equal = _disk_tier(path, codec, items, max(MIN_MAP_BYTES, 4 * payload))
        rows.append(DiskBandwidthRow(codec, stored, payload / write_s / GB, payload / cold_s / GB,
                                     payload / warm_s / GB, raw_write_s / write_s, raw_read_s / cold_s, equal))
    return DiskBandwidthFigures(str(directory), len(items), payload, payload / raw_write_s / GB,
                                payload / raw_read_s / GB, TARGET_SHARE_OF_RAW,
                                resolve_codec(TierConfig().disk_codec, "disk"), rows)


def _disk_tier(path: Path, codec: str, items: list[tuple[bytes, ChunkIdentity, torch.Tensor]],
               map_size: int) -> tuple[float, float, float, int, bool]:
    """Write, cold read and warm read seconds through a disk store at `path`, the bytes stored, and
    whether every chunk came back as written."""
    store = DiskStore(path, map_size=map_size)
    payload = sum(kv.nbytes for _, _, kv in items)
    writer = ChunkWriter("disk", store, codec, max_pending_bytes=payload)  # all queued: the writer's pace is timed
    t0 = time.perf_counter()
    for key, identity, kv in items:
        writer.submit(key, identity, kv)
    writer.wait()
    write_s = time.perf_counter() - t0
    writer.close()
    if writer.num_written != len(items):
        raise RuntimeError(f"the disk writer stored {writer.num_written} of {len(items)} chunks")
    store.close()
    _drop_page_cache(path / "data.mdb")
    store = DiskStore(path, map_size=map_size)
    cold_s, stored, cold_equal = _read_back(store, items)
    warm_s, _, warm_equal = _read_back(store, items)
    store.close()
    return write_s, cold_s, warm_s, stored, cold_equal and warm_equal


def _read_back(store: DiskStore, items: list[tuple[bytes, ChunkIdentity, torch.Tensor]]) -> tuple[float, int, bool]:
    """Reads each chunk as a load does (one get, frame checks, decode); seconds, bytes stored, all equal."""
    seconds, stored, equal = 0.0, 0, True
    for key, identity, kv in items:
        t0 = time.perf_counter()
        value = store.get_many([key])[0]
        payload = decode_frame(value, identity).payload if value is not None else None
        seconds += time.perf_counter() - t0
        stored += len(value or b"")
        equal = equal and payload == _bytes(kv)
    return seconds, stored, equal


def _raw_file(path: Path, kvs: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds to write the bytes sequentially to a plain file (one fsync), and to read it back cold."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(_bytes(kv) for kv in kvs)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    _drop_page_cache(path)
    buf = bytearray(max(kv.nbytes for kv in kvs))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return write_s, read_s


# -- codecs ------------------------------------------------------------------------------------


def run_codecs(c: ComputedPrompt, w: TiersWorkload) -> CodecFigures:
    """Every codec on the model's KV, and on the same KV in bfloat16 (a GPU host's), when that differs."""
    kvs = [kv for _, kv in c.whole_chunks(w.chunk_pages)]
    rows = []
    for dtype in dict.fromkeys((c.geometry.dtype, torch.bfloat16)):
        chunks = [_bytes(kv.to(dtype)) for kv in kvs]
        rows += [_codec_row(name, _dtype_name(dtype), chunks, dtype.itemsize, w.codec_repeats) for name in CODEC_NAMES]
    return CodecFigures(_dtype_name(c.geometry.dtype), len(kvs), sum(kv.nbytes for kv in kvs), rows)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _codec_row(name: str, dtype: str, chunks: list[memoryview], itemsize: int, repeats: int) -> CodecRow:
    codec = get_codec(name)  # the shared one the tiers use, at their level
    payload = sum(b.nbytes for b in chunks)
    # Decoders get views, as decode_frame hands them the payload inside a frame. Decoding is timed with the
    # copy of the result into place, as a load puts it into the device pages (raw decodes to a view of its input).
    encoded = [memoryview(codec.encode(b, itemsize)) for b in chunks]  # also makes this thread's zstd contexts
    exact = all(codec.decode(e, itemsize, b.nbytes) == b for e, b in zip(encoded, chunks, strict=True))
    encode_s = median_time(lambda: [codec.encode(b, itemsize) for b in chunks], repeats)
    out = torch.empty(max(b.nbytes for b in chunks), dtype=torch.uint8)

    def decode_into_place() -> None:
        for e, b in zip(encoded, chunks, strict=True):
            out[: b.nbytes].numpy()[:] = np.frombuffer(codec.decode(e, itemsize, b.nbytes), dtype=np.uint8)

    decode_s = median_time(decode_into_place, repeats)
    return CodecRow(name, dtype, payload / sum(e.nbytes for e in encoded), payload / encode_s / GB,
                    payload / decode_s / GB, exact)


# -- working set ---------------------------------------------------------------------------------


def run_working_set(loaded: LoadedModel, w: TiersWorkload, directory: Path,
                    lookup_wait_share: float) -> WorkingSetFigures:
    tok = loaded.tokenizer
    conversations = [[{"role": "user", "content": f"{document(tok, w.history_tokens, seed=100 + s)}\n\n{q}"}]
                     for s, q in enumerate(questions(w.sessions))]
    first_prompts = [len(tok.encode_chat(m)) for m in conversations]
    working_set = sum(first_prompts)
    mc = loaded.config
    geometry = KVGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, BLOCK_SIZE, loaded.model.dtype)
    token_bytes = geometry.bytes_per_token
    longest_turn = max(first_prompts) + w.rounds * (w.reply_tokens + TURN_TOKENS)  # a request must fit the pool
    device_bytes = max(math.ceil(working_set * w.device_share), longest_turn) * token_bytes
    directory.mkdir()
    tiers = TierConfig(host_bytes=math.ceil(working_set * w.host_share) * token_bytes,
                       disk_bytes=max(MIN_MAP_BYTES, 4 * working_set * token_bytes), disk_path=directory,
                       chunk_pages=w.chunk_pages, lookup_wait_share=lookup_wait_share)
    engines = {"tiers": LLMEngine(loaded, EngineConfig(kv_cache_bytes=device_bytes, tiers=tiers)),
               "device only": LLMEngine(loaded, EngineConfig(kv_cache_bytes=device_bytes))}
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, dict[str, int]] = {name: dict.fromkeys(("prompt", "device", "host", "disk"), 0)
                                         for name in engines}
    wall = dict.fromkeys(engines, 0.0)
    write_wait = dict.fromkeys(engines, 0.0)
    for r in range(w.rounds):
        for s, messages in enumerate(conversations):
            prompt = tok.encode_chat(messages)
            replies = []
            for name, engine in engines.items():
                before = _served(engine)
                t0 = time.perf_counter()
                out = run_request(engine, prompt, w.reply_tokens, session_id=f"session-{s}")
                t1 = time.perf_counter()
                if engine.tiers is not None:
                    engine.tiers.wait()  # the turn's disk writes land before the next request, as between turns
                t2 = time.perf_counter()
                replies.append(out.text)
                if r == 0:
                    continue  # the first round builds the histories and warms both engines up
                wall[name] += t2 - t0
                write_wait[name] += t2 - t1
                ttfts[name].append(out.ttft_s)
                tokens[name]["prompt"] += len(prompt)
                for tier, n in _served(engine).items():
                    tokens[name][tier] += n - before[tier]
            messages += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": follow_up(r)}]
    tiered = engines["tiers"]
    host_slots = tiered.tiers.host.num_slots if tiered.tiers.host is not None else 0
    tiered.close()
    runs = {name: _working_set_run(name, ttfts[name], tokens[name], wall[name], write_wait[name])
            for name in engines}
    return WorkingSetFigures(w.sessions, w.rounds, working_set, tiered.kv.pool.num_blocks, host_slots, BLOCK_SIZE,
                             w.chunk_pages, list(runs.values()),
                             runs["device only"].ttft_p50_ms / runs["tiers"].ttft_p50_ms)


def _served(engine: LLMEngine) -> dict[str, int]:
    """Prompt tokens the engine has served from each tier so far (counted at each request's first token)."""
    c = engine.counters
    return {"device": c.cached_tokens - c.host_tokens - c.disk_tokens - c.remote_tokens, "host": c.host_tokens,
            "disk": c.disk_tokens}


def _working_set_run(name: str, ttfts: list[float], tokens: dict[str, int], wall_s: float,
                     write_wait_s: float) -> WorkingSetRun:
    prompt = tokens["prompt"]
    cached = tokens["device"] + tokens["host"] + tokens["disk"]
    shares = {tier: tokens[tier] / prompt for tier in ("device", "host", "disk")}
    shares["computed"] = (prompt - cached) / prompt
    return WorkingSetRun(name, len(ttfts), prompt, statistics.median(ttfts) * 1e3, _p95(ttfts) * 1e3, shares,
                         wall_s, write_wait_s)


def _p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


# -- helpers -------------------------------------------------------------------------------------


def _gather(pool: DeviceKVPool, block_ids: list[int]) -> torch.Tensor:
    """The pages' K and V, `[layers, 2, pages, block_size, kv_heads, head_dim]`, on CPU."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    return torch.stack([torch.stack((k[idx], v[idx])) for k, v in pool.kv_caches]).cpu()


def _fill(pool: DeviceKVPool, kv: torch.Tensor) -> None:
    """Writes `[layers, 2, pages, ...]` into the first pages of the pool."""
    n = kv.shape[2]
    for layer, (k, v) in enumerate(pool.kv_caches):
        k[:n].copy_(kv[layer, 0])
        v[:n].copy_(kv[layer, 1])


def _zero(pool: DeviceKVPool) -> None:
    for k, v in pool.kv_caches:
        k.zero_()
        v.zero_()


def _bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


def _drop_page_cache(path: Path) -> None:
    """Evicts a file's cached pages (clean ones, not mapped by any process) from the OS page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
