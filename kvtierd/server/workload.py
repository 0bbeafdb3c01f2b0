"""The workload recorder: what finished requests looked like, in bounded memory, kept across restarts.

`Generation` feeds it as each chat, completion or session turn finishes (not the
daemon's own prefix and pin computations), through a `RequestProbe` that also
notes the most device pages in use while the request ran. Each distribution is a
reservoir: a uniform sample of at most RESERVOIR_SIZE of the values seen
(algorithm R) with their exact count and max. Sessions are remembered for their
idle gaps up to MAX_SESSIONS, the least recently used forgotten first. So memory
and the snapshot stay bounded however long the daemon runs.

Everything is kept in tokens and seconds, not pages, so the record survives a
change of block size (the usual outcome of `kvtierctl advise`); `stats()` turns
it into pages of the block size in use. The snapshot is JSON in the state dir,
replaced atomically (`server/workload_routes.py` saves it every few minutes and
at shutdown, and loads it at startup).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtierd.server.workload_report import Distribution, PageFit, WorkloadStats

log = logging.getLogger(__name__)

RESERVOIR_SIZE = 1024  # values kept per distribution: percentiles stay exact up to this many requests
MAX_SESSIONS = 4096  # sessions whose last turn is remembered, to measure the gap before their next one
CANDIDATE_BLOCK_SIZES = (8, 16, 32, 64, 128)
SNAPSHOT_VERSION = 1


@dataclass(slots=True)
class Reservoir:
    count: int = 0
    peak: float = 0
    samples: list[float] = field(default_factory=list)

    def add(self, value: float, rng: random.Random) -> None:
        self.count += 1
        self.peak = max(self.peak, value)
        if len(self.samples) < RESERVOIR_SIZE:
            self.samples.append(value)
        else:  # the count-th value replaces a kept one with probability RESERVOIR_SIZE / count
            slot = rng.randrange(self.count)
            if slot < RESERVOIR_SIZE:
                self.samples[slot] = value

    def estimate_total(self, f: Callable[[float], float]) -> float:
        """The sum of f over every value seen, from the sample (exact while none was dropped)."""
        return self.count * sum(map(f, self.samples)) / len(self.samples) if self.samples else 0.0

    def distribution(self, f: Callable[[float], float] = lambda v: v) -> Distribution:
        """f of the values (a monotonic f, e.g. tokens -> pages): mean, nearest-rank percentiles, max."""
        if not self.samples:
            return Distribution(0, 0.0, 0, 0, 0, 0)
        values = sorted(map(f, self.samples))

        def rank(q: float) -> float:
            return values[max(0, math.ceil(q * len(values)) - 1)]

        return Distribution(self.count, round(sum(values) / len(values), 3), rank(0.5), rank(0.9), rank(0.99),
                            f(self.peak))

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "peak": self.peak, "samples": list(self.samples)}  # a copy: saved off the loop

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reservoir:
        return cls(int(data["count"]), data["peak"], list(data["samples"])[:RESERVOIR_SIZE])


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    tenant: str
    session_id: str | None
    qos_class: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    cache_source: str  # "session", "prefix", "public" or "none"
    peak_used_tokens: int  # the most device pages in use while it ran, in tokens
    peak_high_tokens: int  # the most pages the high class held while it ran, in tokens
    arrived_at: float  # wall clock (time.time()): gaps are measured across restarts
    finished_at: float


class WorkloadRecorder:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.num_requests = 0
        self.num_sessions = 0
        self.num_returns = 0
        self.computed_tokens = 0
        self.prompt_tokens = Reservoir()
        self.completion_tokens = Reservoir()
        self.session_tokens = Reservoir()
        self.idle_gaps = Reservoir()
        self.resume_tokens = Reservoir()  # where a session hit's reuse ended, to the token
        self.request_tokens: dict[str, Reservoir] = {}  # per QoS class: prompt + completion
        self.used_tokens = Reservoir()
        self.high_tokens = Reservoir()  # high requests only
        self.cached_by_source: Counter[str] = Counter()
        self.cached_by_tier: Counter[str] = Counter()
        self.requests_by_source: Counter[str] = Counter()
        self.sessions: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> its last turn's end
        self.earlier_span_s = 0.0  # recorded by earlier runs of the daemon
        self._run: tuple[float, float] | None = None  # this run's first arrival and last end

    def probe(self, pages: Callable[[], tuple[int, int]], block_size: int, tenant: str, session_id: str | None,
              qos_class: str) -> RequestProbe:
        return RequestProbe(self, pages, block_size, tenant, session_id, qos_class)

    def record(self, r: FinishedRequest) -> None:
        rng = self._rng
        start, end = self._run or (r.arrived_at, r.finished_at)
        self._run = (min(start, r.arrived_at), max(end, r.finished_at))
        self.num_requests += 1
        tokens = r.prompt_tokens + r.completion_tokens
        self.computed_tokens += tokens - r.cached_tokens
        self.prompt_tokens.add(r.prompt_tokens, rng)
        self.completion_tokens.add(r.completion_tokens, rng)
        self.request_tokens.setdefault(r.qos_class, Reservoir()).add(tokens, rng)
        self.used_tokens.add(r.peak_used_tokens, rng)
        if r.qos_class == "high":
            self.high_tokens.add(r.peak_high_tokens, rng)
        self.requests_by_source[r.cache_source] += 1
        if r.cache_source != "none":
            self.cached_by_source[r.cache_source] += r.cached_tokens
        self.cached_by_tier.update(r.cached_tokens_by_tier)
        if r.session_id is not None:
            self._session_turn(r, tokens)

    def _session_turn(self, r: FinishedRequest, tokens: int) -> None:
        self.session_tokens.add(tokens, self._rng)
        if r.cache_source == "session":
            self.resume_tokens.add(r.cached_tokens, self._rng)
        key = (r.tenant, r.session_id)
        last_end = self.sessions.pop(key, None)
        if last_end is None:
            self.num_sessions += 1
        else:
            self.num_returns += 1
            # to the millisecond; turns of one session may overlap
            self.idle_gaps.add(round(max(0.0, r.arrived_at - last_end), 3), self._rng)
        self.sessions[key] = r.finished_at
        if len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    @property
    def span_s(self) -> float:
        return self.earlier_span_s + (self._run[1] - self._run[0] if self._run else 0.0)

    def stats(self, block_size: int) -> WorkloadStats:
        def pages(tokens: float) -> int:
            return math.ceil(tokens / block_size)

        return WorkloadStats(
            num_requests=self.num_requests, num_sessions=self.num_sessions, num_returns=self.num_returns,
            span_s=round(self.span_s, 3), computed_tokens=self.computed_tokens,
            prompt_tokens=self.prompt_tokens.distribution(), completion_tokens=self.completion_tokens.distribution(),
            session_tokens=self.session_tokens.distribution(), idle_gap_s=self.idle_gaps.distribution(),
            cached_tokens_by_source=dict(self.cached_by_source), cached_tokens_by_tier=dict(self.cached_by_tier),
            requests_by_source=dict(self.requests_by_source),
            request_pages={c: r.distribution(pages) for c, r in sorted(self.request_tokens.items())},
            used_pages=self.used_tokens.distribution(pages), high_pages=self.high_tokens.distribution(pages),
            page_fit=[self.page_fit(b) for b in CANDIDATE_BLOCK_SIZES],
        )

    def page_fit(self, block_size: int) -> PageFit:
        n = self.num_requests or 1

        def per_request(reservoirs: list[Reservoir], f: Callable[[float], float]) -> float:
            return round(sum(r.estimate_total(f) for r in reservoirs) / n, 3)

        classes = list(self.request_tokens.values())
        return PageFit(
            block_size,
            pages=per_request(classes, lambda t: math.ceil(t / block_size)),
            tail_waste_tokens=per_request(classes, lambda t: -t % block_size),
            resume_loss_tokens=per_request([self.resume_tokens], lambda t: t % block_size),
        )

    # -- the snapshot -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        reservoirs = {name: getattr(self, name).to_json() for name in _RESERVOIRS}
        return {
            "version": SNAPSHOT_VERSION, "num_requests": self.num_requests, "num_sessions": self.num_sessions,
            "num_returns": self.num_returns, "computed_tokens": self.computed_tokens, "span_s": self.span_s,
            **reservoirs, "request_tokens": {c: r.to_json() for c, r in self.request_tokens.items()},
            "cached_by_source": dict(self.cached_by_source), "cached_by_tier": dict(self.cached_by_tier),
            "requests_by_source": dict(self.requests_by_source),
            "sessions": [[tenant, sid, end] for (tenant, sid), end in self.sessions.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadRecorder:
        """Raises ValueError, KeyError or TypeError on a snapshot it cannot read."""
        if data.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {data.get('version')!r}, not {SNAPSHOT_VERSION}")
        rec = cls()
        rec.num_requests, rec.num_sessions = int(data["num_requests"]), int(data["num_sessions"])
        rec.num_returns, rec.computed_tokens = int(data["num_returns"]), int(data["computed_tokens"])
        rec.earlier_span_s = float(data["span_s"])
        for name in _RESERVOIRS:
            setattr(rec, name, Reservoir.from_json(data[name]))
        rec.request_tokens = {str(c): Reservoir.from_json(r) for c, r in data["request_tokens"].items()}
        rec.cached_by_source = Counter(data["cached_by_source"])
        rec.cached_by_tier = Counter(data["cached_by_tier"])
        rec.requests_by_source = Counter(data["requests_by_source"])
        rec.sessions = OrderedDict(((str(t), str(s)), float(end)) for t, s, end in data["sessions"][-MAX_SESSIONS:])
        return rec


_RESERVOIRS = ("prompt_tokens", "completion_tokens", "session_tokens", "idle_gaps", "resume_tokens", "used_tokens",
               "high_tokens")


@dataclass(slots=True)
class RequestProbe:
    """One request on its way: the busiest moment it saw, recorded with its result when it finishes."""

    recorder: WorkloadRecorder
    pages: Callable[[], tuple[int, int]]  # (used, high) device pages, from the engine's snapshot between steps
    block_size: int
    tenant: str
    session_id: str | None
    qos_class: str
    arrived_at: float = field(default_factory=time.time)
    peak_used_pages: int = 0
    peak_high_pages: int = 0

    def sample(self) -> None:
        """At each output: the pages in use as of the last step."""
        used, high = self.pages()
        self.peak_used_pages = max(self.peak_used_pages, used)
        self.peak_high_pages = max(self.peak_high_pages, high)

    def finish(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               cached_tokens_by_tier: dict[str, int], cache_source: str) -> None:
        self.recorder.record(FinishedRequest(
            self.tenant, self.session_id, self.qos_class, prompt_tokens, completion_tokens, cached_tokens,
            dict(cached_tokens_by_tier), cache_source, self.peak_used_pages * self.block_size,
            self.peak_high_pages * self.block_size, self.arrived_at, time.time()))


def load_recorder(path: Path) -> WorkloadRecorder:
    """The snapshot at `path`; an empty recorder when there is none, or it cannot be read (logged)."""
    try:
        return WorkloadRecorder.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return WorkloadRecorder()
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("workload snapshot %s not read, recording afresh: %s", path, e)
        return WorkloadRecorder()


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    """Replaces the snapshot atomically: a crash leaves the old one or the new one, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(snapshot, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
