"""Restore or recompute: whether loading a prompt's stored chunks beats computing their tokens again.

    load(chunk)       = its bytes / the measured bandwidth of its tier
    recompute(chunk)  = its tokens / the measured prefill speed

Both rates are measured on this host as it serves and kept current by an
exponential moving average: the tier manager reports every load (bytes,
seconds, from the store's read to the last device write), the engine every step
that computed prompt tokens (tokens, seconds). The first report of a kind sets
its rate however short it was (a fast host's load of a small chunk takes a few
microseconds); later reports shorter than MIN_MEASURED_S are pooled until their
sum is not, so clock noise never moves the average alone. A chunk is worth loading only
once the chunks before it are (a chain is a prefix), so the plan loads the
leading run of chunks whose cumulative saving is largest and recomputes the
rest. Until a rate is measured, loading is assumed to win: on a CPU it almost
always does; on a GPU with fast prefill and a slow remote tier it may not.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

PREFILL = "prefill"  # the prefill speed's key among the tiers' bandwidths
EWMA_WEIGHT = 0.2  # of each new measurement: a few loads or steps move the estimate
MIN_MEASURED_S = 1e-4  # after the first, shorter timings are pooled: alone they are mostly clock noise


@dataclass(frozen=True, slots=True)
class ChunkCost:
    tier: str  # where the chunk is: "host", "disk" or "remote"
    nbytes: int  # KV bytes a load would copy to the device
    tokens: int  # prompt tokens it holds (what a recompute would compute)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    num_chunks: int  # load the first num_chunks found chunks; compute the rest
    num_found: int
    load_s: float | None  # estimated time to load every found chunk (None: a tier's bandwidth is unmeasured)
    recompute_s: float | None  # estimated time to compute their tokens instead (None: prefill speed unmeasured)

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


class RestorePlanner:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # loads are reported from the engine thread, rates read by /metrics
        self._rates: dict[str, float] = {}  # "prefill" -> tokens/s; a tier -> bytes/s
        self._pooled: dict[str, tuple[int, float]] = {}  # short reports not yet folded in: (amount, seconds)
        self.decisions: Counter[str] = Counter()  # decision -> requests

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        self._observe(tier, nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self._observe(PREFILL, tokens, seconds)

    def _observe(self, kind: str, amount: int, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        with self._lock:
            pooled_amount, pooled_s = self._pooled.pop(kind, (0, 0.0))
            amount, seconds = amount + pooled_amount, seconds + pooled_s
            if kind in self._rates and seconds < MIN_MEASURED_S:
                self._pooled[kind] = (amount, seconds)
            else:
                self._rates[kind] = _ewma(self._rates.get(kind), amount / seconds)

    def plan(self, chunks: Sequence[ChunkCost]) -> RestorePlan:
        """The cheapest way to serve `chunks` (in chain order), counted in `decisions`."""
        bandwidth, prefill = self.rates()
        loads = [c.nbytes / bandwidth[c.tier] if c.tier in bandwidth else None for c in chunks]
        recomputes = [c.tokens / prefill if prefill else None for c in chunks]
        best, best_saving, saving = len(chunks), 0.0, 0.0
        if all(x is not None for x in loads + recomputes):
            best = 0
            for i, (load, recompute) in enumerate(zip(loads, recomputes)):
                saving += recompute - load
                if saving > best_saving:
                    best, best_saving = i + 1, saving
        plan = RestorePlan(best, len(chunks), _total(loads), _total(recomputes))
        if chunks:
            self.decisions[plan.decision] += 1
        return plan

    def rates(self) -> tuple[dict[str, float], float | None]:
        """(bytes/s per tier, prefill tokens/s) as measured so far."""
        with self._lock:
            rates = dict(self._rates)
        return rates, rates.pop(PREFILL, None)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)


def _total(parts: Sequence[float | None]) -> float | None:
    return None if any(p is None for p in parts) else sum(parts)  # type: ignore[arg-type]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
