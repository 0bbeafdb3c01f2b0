"""What GET /admin/workload reports: the recorded workload and the cache configuration it ran on.

The daemon builds it (`server/workload.py`, `server/workload_routes.py`) and
`kvtierctl advise` reads it back (`cli/advice.py`), so it is plain data in tokens,
pages and seconds, with a JSON round trip and no import beyond the standard library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Distribution:
    """Count, exact mean and max, and nearest-rank percentiles of a sample of the values."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class PageFit:
    """The recorded requests cut into pages of one size: means per request."""

    block_size: int
    pages: float  # pages its tokens fill
    tail_waste_tokens: float  # empty slots of its last page
    resume_loss_tokens: float  # tokens of the partial page where a session turn's reuse ended


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    num_requests: int
    num_sessions: int  # sessions whose first turn was recorded
    num_returns: int  # turns of a session seen before: each has an idle gap
    span_s: float  # first request's arrival to last one's end, summed over the daemon's runs
    computed_tokens: int  # KV tokens written: prompt tokens not found cached, plus completions
    prompt_tokens: Distribution
    completion_tokens: Distribution
    session_tokens: Distribution  # a session's length after each of its turns
    idle_gap_s: Distribution  # a returning session's time from its previous turn's end to this turn
    cached_tokens_by_source: dict[str, int]  # session, prefix (the tenant's index), public
    cached_tokens_by_tier: dict[str, int]  # device, host, disk, remote
    requests_by_source: dict[str, int]  # where each request's hit came from ("none": no hit)
    request_pages: dict[str, Distribution]  # per QoS class: pages a request's tokens filled
    used_pages: Distribution  # the most device pages in use while a request ran
    high_pages: Distribution  # the most pages the high class held while a high request ran
    page_fit: list[PageFit]  # one per candidate block size


@dataclass(frozen=True, slots=True)
class CacheFacts:
    """The configuration the advice compares against (settings, and what the engine made of them)."""

    block_size: int
    device_pages: int
    bytes_per_page: int
    kv_cache_bytes: int
    host_bytes: int
    disk_bytes: int
    context_window: int
    reserved_share: float
    reserved_min_share: float
    reserved_max_share: float
    reserved_pages: int | None  # the reserved region now; None: there is none
    reserved_floor: int | None
    reserved_ceiling: int | None


@dataclass(frozen=True, slots=True)
class WorkloadReport:
    workload: WorkloadStats
    config: CacheFacts

    def to_json(self) -> dict[str, Any]:
        return {"workload": asdict(self.workload), "config": asdict(self.config)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadReport:
        """Raises KeyError or TypeError on a malformed report."""
        w = dict(data["workload"])
        for name in ("prompt_tokens", "completion_tokens", "session_tokens", "idle_gap_s", "used_pages", "high_pages"):
            w[name] = Distribution(**w[name])
        w["request_pages"] = {c: Distribution(**d) for c, d in w["request_pages"].items()}
        w["page_fit"] = [PageFit(**p) for p in w["page_fit"]]
        return cls(WorkloadStats(**w), CacheFacts(**data["config"]))
