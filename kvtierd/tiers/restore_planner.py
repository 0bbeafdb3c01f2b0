"""Restore or recompute: whether loading a prompt's stored chunks beats computing their tokens again.

    load(chunk)        = its tier's per-call latency + its bytes x the tier's seconds per byte
    load(k chunks)     = their loads' sum / min(k, LOADS_AHEAD)
    recompute(tokens)  = what the engine says computing that many prompt tokens costs (`recompute_cost`)

A load's two terms are fitted per tier from the loads this host makes (the
tier manager reports each: bytes, seconds from the store's read to the last
device write) by least squares, each load weighted by how recent it is. A rate
(bytes over seconds) would not do: a small load is mostly its fixed cost, so a
rate learned from small loads makes a large one look many times slower than it
is. Until a tier has loads of two sizes its cost is a rate through the origin.

The recompute side has the same trap (a prefill of a few tokens is mostly the
step's fixed overhead), and the engine already fits its steps as overhead plus
per-token costs (engine/step_cost.py), so the engine hands the planner that
fit as a callable: tiers/ does not import engine/.

A request's loads run LOADS_AHEAD at a time (cache/loading.py), and what a
load's time is observed as is its wall time beside the others': beside the
running requests' steps they take turns, so each time holds the other's
turns too; on an idle engine they run on two cores side by side; a far
Redis's round trips overlap. Summed one after another, the loads of a
2,560-token prompt through a Redis 300 ms away were estimated at 1.3 s
against 0.45 s; over LOADS_AHEAD, at 0.43 s.

A chunk is worth loading only once the chunks before it are (a chain is a
prefix), so the plan loads the leading run of chunks whose cumulative saving is
largest and recomputes the rest. Until both sides are known, loading is assumed
to win: on a CPU it almost always does; on a GPU with fast prefill and a slow
remote tier it may not.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.tiers.tier import Tier

# A request's chunk loads submitted and not finished, at most: the next chunk's pages are taken (evicting what
# they held, saved below first: ~1 ms a chunk on the step thread) as a load ends, not all at its start. A loaded
# 2,560-token prompt's ten chunks, taken at once from a full pool, held one step 6-8 ms (`bench stall`).
LOADS_AHEAD = 2
HALF_LIFE_LOADS = 32.0  # a tier's fit follows its last few dozen loads: the machine's load changes
REFERENCE_TOKENS = 1024  # the recompute whose speed /metrics shows

# Seconds to compute this many prompt tokens, or None while unknown (the engine's step-cost fit).
RecomputeCost = Callable[[int], "float | None"]


@dataclass(frozen=True, slots=True)
class ChunkCost:
    tier: Tier  # where the chunk is
    nbytes: int  # KV bytes a load would copy to the device
    tokens: int  # prompt tokens it holds (what a recompute would compute)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    num_chunks: int  # load the first num_chunks found chunks; compute the rest
    num_found: int
    load_s: float | None  # estimated time to load every found chunk (None: a tier's cost is unmeasured)
    recompute_s: float | None  # estimated time to compute their tokens instead (None: prefill cost unknown)

    @property
    def decision(self) -> str:
        """"load" (all found chunks), "recompute" (none), "partial", or "none" (nothing was found below)."""
        if self.num_found == 0:
            return "none"
        if self.num_chunks == self.num_found:
            return "load"
        return "recompute" if self.num_chunks == 0 else "partial"

    def as_dict(self) -> dict:
        return {"decision": self.decision, "chunks_loaded": self.num_chunks, "chunks_found": self.num_found,
                "load_ms_est": _ms(self.load_s), "recompute_ms_est": _ms(self.recompute_s)}


NOTHING_BELOW = RestorePlan(0, 0, None, None)


@dataclass(frozen=True, slots=True)
class LoadCost:
    latency_s: float  # what every load from the tier pays (a round trip, a lookup, a frame's checks)
    byte_s: float  # seconds per KV byte beyond that

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + self.byte_s * nbytes


class LoadCostFit:
    """seconds = latency + bytes x seconds-per-byte, least squares over the observed loads weighted by how
    recent they are; both terms kept non-negative."""

    def __init__(self, half_life: float = HALF_LIFE_LOADS) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # weighted sums

    def observe(self, nbytes: int, seconds: float) -> None:
        d, x, y = self._decay, float(nbytes), seconds
        self._w, self._x, self._y = d * self._w + 1, d * self._x + x, d * self._y + y
        self._xx, self._xy = d * self._xx + x * x, d * self._xy + x * y

    def current(self) -> LoadCost | None:
        if self._w == 0:
            return None
        det = self._w * self._xx - self._x * self._x
        if det > 1e-9 * self._w * self._xx:  # loads of more than one size: both terms
            byte_s = (self._w * self._xy - self._x * self._y) / det
            latency_s = (self._y - byte_s * self._x) / self._w
            if byte_s >= 0 and latency_s >= 0:
                return LoadCost(latency_s, byte_s)
            if byte_s < 0:  # larger loads no slower (noise): a fixed cost
                return LoadCost(self._y / self._w, 0.0)
        return LoadCost(0.0, self._xy / self._xx)  # one size so far, or the latency came out negative: a rate


class RestorePlanner:
    def __init__(self, recompute_cost: RecomputeCost | None = None) -> None:
        self._lock = threading.Lock()  # loads are reported from transfer workers, costs read by /metrics
        self._loads: dict[Tier, LoadCostFit] = {}
        self.recompute_cost = recompute_cost  # set by the engine (its step-cost fit); None: unknown
        self.decisions: Counter[str] = Counter()  # decision -> requests

    def observe_load(self, tier: Tier, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._loads.setdefault(tier, LoadCostFit()).observe(nbytes, seconds)

    def load_costs(self) -> dict[Tier, LoadCost]:
        """Each measured tier's fitted load cost."""
        with self._lock:
            costs = {tier: fit.current() for tier, fit in self._loads.items()}
        return {tier: c for tier, c in costs.items() if c is not None}

    def recompute_s(self, tokens: int) -> float | None:
        return self.recompute_cost(tokens) if self.recompute_cost is not None and tokens > 0 else None

    def plan(self, chunks: Sequence[ChunkCost]) -> RestorePlan:
        """The cheapest way to serve `chunks` (in chain order), counted in `decisions`."""
        costs = self.load_costs()
        loads = [costs[c.tier].seconds(c.nbytes) if c.tier in costs else None for c in chunks]
        # recomputes[i]: the first i chunks' tokens computed (not additive: a step's overhead is shared).
        recomputes = [self.recompute_s(t) for t in itertools.accumulate((c.tokens for c in chunks), initial=0)]
        recomputes[0] = 0.0
        best = len(chunks)
        if all(x is not None for x in loads + recomputes):
            best, best_saving, load_sum = 0, 0.0, 0.0
            for i, load in enumerate(loads):
                load_sum += load
                saving = recomputes[i + 1] - load_sum / min(i + 1, LOADS_AHEAD)
                if saving > best_saving:
                    best, best_saving = i + 1, saving
        total, lanes = _total(loads), max(1, min(len(chunks), LOADS_AHEAD))
        plan = RestorePlan(best, len(chunks), None if total is None else total / lanes,
                           recomputes[-1] if chunks else None)
        if chunks:
            self.decisions[plan.decision] += 1
        return plan

    def rates(self) -> tuple[dict[Tier, float], float | None]:
        """(bytes/s per tier for a large load, prefill tokens/s of a REFERENCE_TOKENS recompute), for /metrics."""
        bandwidth = {tier: 1.0 / c.byte_s if c.byte_s > 0 else float("inf") for tier, c in self.load_costs().items()}
        seconds = self.recompute_s(REFERENCE_TOKENS)
        return bandwidth, REFERENCE_TOKENS / seconds if seconds else None


def _total(parts: Sequence[float | None]) -> float | None:
    return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
