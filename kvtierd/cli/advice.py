"""What `kvtierctl advise` recommends, from a WorkloadReport, each with the numbers behind it.

A pure function of the report (no I/O), so it is tested on constructed statistics.

- block_size: per request, a page size costs its empty tail slots (device memory
  held and unused), the partial page where a session turn's reuse ends (copied on
  write from the session's pool, or recomputed when the reuse goes by whole pages:
  the prefix index, the lower tiers, a restart), and PAGE_COST_TOKENS per page (a
  block-table entry, a hash, an index entry, one more gather in attention). The
  cheapest candidate wins; the current size wins a tie.
- kv_cache_bytes, host_bytes, disk_bytes: an LRU tier keeps what was written in
  its last W seconds (W = its size / the rate KV is written), so a session that
  comes back after a gap g finds its KV there if g <= W. The device holds the
  pages in use (p99) plus the median gap's writes, the host the p90 gap's, the
  disk the p99 gap's (raw bytes: zstd frames on disk take less).
- reserved_share: the high class's p99 page demand with the resizing reserve's
  headroom, as a share of the device pages, within the floor and the ceiling
  (none at all when no high-class request was seen).

Too few requests, session returns or high-class requests give no number, and say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtierd.cache.reserved_region import HEADROOM
from kvtierd.server.workload_report import WorkloadReport

MIN_REQUESTS = 20
MIN_RETURNS = 10  # session turns after an earlier one: the idle gaps the tier sizes follow
MIN_HIGH_REQUESTS = 10
PAGE_COST_TOKENS = 1.0  # what a page costs besides its KV, in tokens: a guess of the order of one token
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Recommendation:
    setting: str
    unit: str  # "tokens", "bytes" or "share"
    current: float
    recommended: float | None  # None: not enough data (`why` says what is missing)
    why: str


def recommend(report: WorkloadReport) -> list[Recommendation]:
    return [block_size(report), *tier_sizes(report), reserved_share(report)]


def block_size(report: WorkloadReport) -> Recommendation:
    w, c = report.workload, report.config
    if w.num_requests < MIN_REQUESTS:
        return _not_enough("block_size", "tokens", c.block_size, w.num_requests, "requests", MIN_REQUESTS)
    cost = {f.block_size: round(f.pages * PAGE_COST_TOKENS + f.tail_waste_tokens + f.resume_loss_tokens, 3)
            for f in w.page_fit}
    best = min(cost, key=lambda b: (cost[b], b != c.block_size))
    terms = "; ".join(f"{f.block_size}: {f.pages:.1f} + {f.tail_waste_tokens:.1f} + {f.resume_loss_tokens:.1f} = "
                      f"{cost[f.block_size]:.1f}" for f in w.page_fit)
    return Recommendation("block_size", "tokens", c.block_size, best,
                          f"cost per request over {w.num_requests} requests, in tokens = pages x {PAGE_COST_TOKENS:g}"
                          f" + empty tail slots + partial page at session resumes: {terms}; lowest at {best}")


def tier_sizes(report: WorkloadReport) -> list[Recommendation]:
    w, c = report.workload, report.config
    current = {"kv_cache_bytes": c.kv_cache_bytes, "host_bytes": c.host_bytes, "disk_bytes": c.disk_bytes}
    if w.num_requests < MIN_REQUESTS:
        return [_not_enough(n, "bytes", v, w.num_requests, "requests", MIN_REQUESTS) for n, v in current.items()]
    if w.num_returns < MIN_RETURNS or w.span_s <= 0:
        return [_not_enough(n, "bytes", v, w.num_returns, "session returns", MIN_RETURNS) for n, v in current.items()]
    rate = w.computed_tokens / w.span_s  # KV tokens written per second, averaged over the recorded span
    gaps = w.idle_gap_s
    window_tokens = math.ceil(gaps.p50 * rate)
    window_pages = math.ceil(window_tokens / c.block_size)
    in_use = int(w.used_pages.p99)
    context_pages = math.ceil(c.context_window / c.block_size)  # one request of the whole window must fit
    pages = max(in_use + window_pages, context_pages)
    raised = f", raised to one context window, {context_pages:,} pages" if pages > in_use + window_pages else ""
    device = Recommendation(
        "kv_cache_bytes", "bytes", c.kv_cache_bytes, _mib_up(pages * c.bytes_per_page),
        f"p99 {in_use:,} pages in use + {window_pages:,} pages for the half of {w.num_returns} session returns that "
        f"came within {gaps.p50:,.1f} s (x {rate:,.2f} KV tokens/s written = {window_tokens:,} tokens) = "
        f"{in_use + window_pages:,} pages{raised}; x {c.bytes_per_page:,} bytes")
    return [device, _window("host_bytes", c.host_bytes, "90%", gaps.p90, rate, report),
            _window("disk_bytes", c.disk_bytes, "99%", gaps.p99, rate, report)]


def _window(setting: str, current: int, share: str, gap_s: float, rate: float,
            report: WorkloadReport) -> Recommendation:
    """A tier that keeps the KV written in the last `gap_s`, for the `share` of returns that came back within it."""
    c = report.config
    tokens = math.ceil(gap_s * rate)
    per_token = c.bytes_per_page / c.block_size
    return Recommendation(setting, "bytes", current, _mib_up(tokens * per_token),
                          f"{share} of {report.workload.num_returns} session returns came within {gap_s:,.1f} s: "
                          f"x {rate:,.2f} KV tokens/s written = {tokens:,} tokens x {per_token:,g} bytes")


def reserved_share(report: WorkloadReport) -> Recommendation:
    w, c = report.workload, report.config
    high = w.high_pages
    if w.num_requests < MIN_REQUESTS:
        return _not_enough("reserved_share", "share", c.reserved_share, w.num_requests, "requests", MIN_REQUESTS)
    if high.count == 0:
        return Recommendation("reserved_share", "share", c.reserved_share, 0.0,
                              f"no high-class request among {w.num_requests}: a reserve would sit idle")
    if high.count < MIN_HIGH_REQUESTS:
        return _not_enough("reserved_share", "share", c.reserved_share, high.count, "high-class requests",
                           MIN_HIGH_REQUESTS)
    pages = math.ceil(high.p99 * HEADROOM)
    share = -(-pages * 1000 // c.device_pages) / 1000  # rounded up to a tenth of a percent
    recommended = min(max(share, c.reserved_min_share), c.reserved_max_share)
    clamped = "" if recommended == share else \
        f"; the {'floor' if recommended == c.reserved_min_share else 'ceiling'}, {recommended:.1%}"
    return Recommendation("reserved_share", "share", c.reserved_share, recommended,
                          f"the high class's p99 demand over {high.count} high requests, {high.p99:g} pages, "
                          f"x {HEADROOM:g} headroom = {pages} of {c.device_pages} device pages = {share:.1%}{clamped}")


def _not_enough(setting: str, unit: str, current: float, have: int, what: str, need: int) -> Recommendation:
    return Recommendation(setting, unit, current, None, f"not enough data: {have} {what} recorded, {need} needed")


def _mib_up(num_bytes: float) -> int:
    """Rounded up to whole MiB (at least one): sizes an operator can write down."""
    return max(1, math.ceil(num_bytes / MIB)) * MIB
