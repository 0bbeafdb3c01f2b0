"""Metric families that mirror the engine's and the server's own counters, read once per scrape.

The /metrics handler builds an `EngineCollector` through `AsyncEngine.call`, so
every number of one scrape comes from the same moment between two engine steps.
Hit tokens carry a `tier` label (device, host, disk, remote); the lower tiers add their
bytes, chunks, writes, evictions, corrupt values and health.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.server.chunk_catalog import CatalogReconciliation
from kvtierd.server.state import ServerCounters
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.transfer import TRANSFER_BUCKETS_S

TIER = "device"


class EngineCollector:
    def __init__(self, engine: LLMEngine, server: ServerCounters, uptime_s: float,
                 reconciliation: CatalogReconciliation | None = None) -> None:
        self._families = list(_families(engine, server, uptime_s))
        if reconciliation is not None:
            orphans = CounterMetricFamily("kvtierd_disk_orphans_removed", "Orphans the startup reconciliation of the "
                                          "disk tier with the SQL chunk catalog removed: LMDB values no row named, "
                                          "rows naming no value.", labels=["side"])
            orphans.add_metric(["values"], reconciliation.orphan_values)
            orphans.add_metric(["rows"], reconciliation.orphan_rows)
            self._families.append(orphans)

    def collect(self) -> list[Metric]:
        return self._families


def _families(eng: LLMEngine, server: ServerCounters, uptime_s: float) -> Iterator[Metric]:
    c, pool, kv = eng.counters, eng.kv.pool, eng.kv
    yield GaugeMetricFamily("kvtierd_uptime_seconds", "Seconds since the daemon started.", uptime_s)

    yield CounterMetricFamily("kvtierd_requests", "Requests added to the engine.", c.requests)
    requests = GaugeMetricFamily("kvtierd_engine_requests", "Requests in the engine now, by state.", labels=["state"])
    requests.add_metric(["running"], len(eng.scheduler.running))
    requests.add_metric(["waiting"], len(eng.scheduler.waiting))
    requests.add_metric(["loading"], len(eng.scheduler.loading))  # their prefix is on its way from below
    yield requests
    yield CounterMetricFamily("kvtierd_prompt_tokens", "Prompt tokens of the requests added.", c.prompt_tokens)
    hits = CounterMetricFamily("kvtierd_cache_hit_tokens", "Prompt tokens served from the cache, by the tier they "
                               "were found in (host, disk and remote ones were loaded into the device).",
                               labels=["tier"])
    hits.add_metric([TIER], c.device_tokens)
    hits.add_metric(["host"], c.host_tokens)
    hits.add_metric(["disk"], c.disk_tokens)
    hits.add_metric(["remote"], c.remote_tokens)
    yield hits
    yield CounterMetricFamily("kvtierd_generated_tokens", "Tokens generated.", c.generated_tokens)
    yield CounterMetricFamily("kvtierd_preemptions", "Requests preempted for lack of pages (recomputed later).",
                              c.preemptions)
    yield CounterMetricFamily("kvtierd_aborted_requests", "Requests cancelled before they finished (the client "
                              "hung up, or the engine stopped).", c.aborted)

    idle_cached = len(pool.idle_cached_blocks())
    pages = GaugeMetricFamily("kvtierd_pages", "KV pages by state: used (held by requests), cached (idle but "
                              "indexed, reusable until evicted) and free (holding nothing).", labels=["tier", "state"])
    pages.add_metric([TIER, "used"], pool.num_used_blocks)
    pages.add_metric([TIER, "cached"], idle_cached)
    pages.add_metric([TIER, "free"], pool.num_free_blocks - idle_cached)
    yield pages
    yield _per_tier("kvtierd_pages_capacity", "KV pages a tier holds.", GaugeMetricFamily, pool.num_blocks)
    evictions = CounterMetricFamily("kvtierd_cache_evictions", "Pages dropped from the prefix index, by reason.",
                                    labels=["tier", "reason"])
    for reason, n in asdict(pool.evictions).items():
        evictions.add_metric([TIER, reason], n)
    yield evictions
    # One number for every tenant (tenants are unbounded, so never a label): kvtierctl tiers --tenant has each.
    yield CounterMetricFamily("kvtierd_cache_evictions_under_share", "Device pages evicted for capacity from a "
                              "tenant under its weighted share of the cached pages (with shares on: only when no "
                              "tenant above its share had an idle page).", eng.cache_shares.num_evictions_under_share)
    yield _per_tier("kvtierd_cache_token_mismatches",
                    "Hash hits refused because the stored tokens differ (never served).",
                    CounterMetricFamily, pool.index.num_token_mismatches)
    yield GaugeMetricFamily("kvtierd_session_pools", "Sessions whose context pool is kept for their next turn.",
                            len(kv.sessions))
    yield GaugeMetricFamily("kvtierd_page_fragmentation_ratio",
                            "Unused token slots in the pages of running requests / their allocated slots.",
                            _fragmentation(eng))
    frag = kv.fragmentation()  # cache/fragmentation.py defines both ratios
    yield GaugeMetricFamily("kvtierd_free_space_fragmentation_ratio",
                            "1 - the longest run of free device page ids / the free pages.", frag.free_space)
    yield GaugeMetricFamily("kvtierd_sequence_fragmentation_ratio",
                            "Pages of sequences, session pools and cached chains not followed by their next page "
                            "/ all pages with a next page.", frag.sequence)
    yield CounterMetricFamily("kvtierd_compactions", "Compactions of the device pages (kvtierctl compact, or idle "
                              "past [cache] compact_threshold).", c.compactions)
    yield CounterMetricFamily("kvtierd_compacted_pages", "Live device pages moved by compactions.", c.compacted_pages)

    step = eng.last_step
    step_s = GaugeMetricFamily("kvtierd_engine_last_step_seconds", "Duration of the last engine step, by part: "
                               "forward (model and logits) and total (with scheduling and sampling).", labels=["part"])
    step_s.add_metric(["forward"], step.forward_s if step else 0.0)
    step_s.add_metric(["total"], step.total_s if step else 0.0)
    yield step_s
    yield GaugeMetricFamily("kvtierd_engine_last_step_tokens", "Tokens computed in the last engine step.",
                            step.num_tokens if step else 0)
    yield GaugeMetricFamily("kvtierd_engine_last_step_threads", "torch threads the last engine step computed with: "
                            "one fewer while the KV tiers' stores or prefetches ran.", step.threads if step else 0)

    yield from _qos(eng)
    yield from _lower_tiers(eng)

    errors = CounterMetricFamily("kvtierd_http_errors", "Error responses, by status class.", labels=["status_class"])
    errors.add_metric(["4xx"], server.errors_4xx)
    errors.add_metric(["5xx"], server.errors_5xx)
    yield errors
    yield GaugeMetricFamily("kvtierd_http_active_streams", "SSE responses streaming now.", server.active_streams)


def _qos(eng: LLMEngine) -> Iterator[Metric]:
    """The reserved region, the high class's pages, pins, and requests refused (waited too long, or shed)."""
    pool = eng.kv.pool
    reserve = pool.reserve
    yield GaugeMetricFamily("kvtierd_reserved_pages", "Device pages only high priority may take (0: no reserve).",
                            reserve.pages if reserve else 0)
    yield CounterMetricFamily("kvtierd_reserved_resizes", "Times the reserved region resized itself.",
                              len(reserve.history) if reserve else 0)
    yield GaugeMetricFamily("kvtierd_high_pages", "Device pages held by high-priority requests.", pool.num_high_blocks)
    yield GaugeMetricFamily("kvtierd_pinned_pages", "Device pages held by pins.", pool.num_pinned_blocks)
    yield GaugeMetricFamily("kvtierd_pins", "Pinned prefixes and sessions.", len(eng.kv.pins))
    rejected = CounterMetricFamily("kvtierd_qos_rejected", "Requests refused (503) after waiting past their "
                                   "class's max_queue_s.", labels=["priority"])
    for cls, n in eng.counters.rejected.items():
        rejected.add_metric([cls], n)
    yield rejected
    yield CounterMetricFamily("kvtierd_qos_shed", "Queued low-priority requests refused (503) while a high-priority "
                              "one waited past shed_low_after_s.", eng.counters.shed)


def _lower_tiers(eng: LLMEngine) -> Iterator[Metric]:
    """Host and disk: what they hold, what they did, and whether they work."""
    stats = eng.tier_stats()
    families = {
        "bytes": GaugeMetricFamily("kvtierd_tier_bytes", "Bytes of a lower tier, by state (used, capacity).",
                                   labels=["tier", "state"]),
        "chunks": GaugeMetricFamily("kvtierd_tier_chunks", "Chunks stored in a lower tier.", labels=["tier"]),
        "writes": CounterMetricFamily("kvtierd_tier_writes", "Chunks written to a lower tier.", labels=["tier"]),
        "dropped": CounterMetricFamily("kvtierd_tier_dropped_writes", "Chunks not written (queue full or store "
                                       "failed).", labels=["tier"]),
        "pending": GaugeMetricFamily("kvtierd_tier_pending_writes", "Chunks copied out, not yet committed.",
                                     labels=["tier"]),
        "evictions": CounterMetricFamily("kvtierd_tier_evictions", "Values a lower tier dropped for room.",
                                         labels=["tier"]),
        "corrupt": CounterMetricFamily("kvtierd_tier_corrupt_values", "Values that failed their checks (never "
                                       "served; quarantined on disk).", labels=["tier"]),
        "healthy": GaugeMetricFamily("kvtierd_tier_healthy", "1 when a lower tier is enabled and working.",
                                     labels=["tier"]),
        "known": GaugeMetricFamily("kvtierd_tier_known_chunks", "Chunks the remote tier's directory knows the "
                                   "fleet holds (absent: not following its stores).", labels=["tier"]),
    }
    for t in stats:
        families["bytes"].add_metric([t.name, "used"], t.used_bytes)
        families["bytes"].add_metric([t.name, "capacity"], t.capacity_bytes)
        families["chunks"].add_metric([t.name], t.entries)
        families["writes"].add_metric([t.name], t.writes)
        families["dropped"].add_metric([t.name], t.dropped_writes)
        families["pending"].add_metric([t.name], t.pending_writes)
        families["evictions"].add_metric([t.name], t.evictions)
        families["corrupt"].add_metric([t.name], t.corrupt)
        families["healthy"].add_metric([t.name], float(t.enabled and t.healthy))
        if t.known_chunks is not None:
            families["known"].add_metric([t.name], t.known_chunks)
    yield from families.values()
    if eng.tiers is not None:
        yield from _restore(eng.tiers)


def _restore(tiers: TierManager) -> Iterator[Metric]:
    """Prefetches, and the restore planner: its decisions and the rates it weighs."""
    prefetched = CounterMetricFamily("kvtierd_tier_prefetched_chunks", "Chunks copied up to the host tier before "
                                     "their request was scheduled, by the tier they came from.", labels=["tier"])
    for t in tiers.stats():
        if t.name != "host":
            prefetched.add_metric([t.name], t.prefetched)
    yield prefetched
    decisions = CounterMetricFamily("kvtierd_restore_decisions", "Requests that found chunks below the device, by "
                                    "what was cheaper: load (all), partial, or recompute.", labels=["decision"])
    for decision in ("load", "partial", "recompute"):
        decisions.add_metric([decision], tiers.planner.decisions[decision])
    yield decisions
    bandwidth, prefill = tiers.planner.rates()
    load = GaugeMetricFamily("kvtierd_tier_load_bytes_per_second", "Speed of a large load into the device, "
                             "by tier, fitted from the host's loads beside a per-load latency.", labels=["tier"])
    for tier, rate in sorted(bandwidth.items()):
        load.add_metric([tier], rate)
    yield load
    yield GaugeMetricFamily("kvtierd_prefill_tokens_per_second", "Prefill speed of a 1,024-token recompute "
                            "(the engine's step-cost fit), what a load is weighed against; 0 while unknown.", prefill or 0.0)
    yield from _transfers(tiers)


def _transfers(tiers: TierManager) -> Iterator[Metric]:
    """Loads and stores between the device and the tiers below: their times, bytes, and what is under way."""
    seconds = HistogramMetricFamily("kvtierd_transfer_seconds", "Time of each chunk transfer, by tier and direction "
                                    "(load: into device pages; store: out of them, encoding included).",
                                    labels=["tier", "direction"])
    nbytes = CounterMetricFamily("kvtierd_transfer_bytes", "KV bytes moved by chunk transfers, by tier and "
                                 "direction.", labels=["tier", "direction"])
    for (tier, direction), h in sorted(tiers.transfer_stats.snapshot().items()):
        buckets = [(repr(b), n) for b, n in zip(TRANSFER_BUCKETS_S, h.bucket_counts)] + [("+Inf", h.count)]
        seconds.add_metric([tier, direction], buckets, h.sum_s)
        nbytes.add_metric([tier, direction], h.nbytes)
    yield seconds
    yield nbytes
    yield GaugeMetricFamily("kvtierd_transfers_in_flight", "Chunk loads queued or running on the transfer workers.",
                            tiers.transfers.num_in_flight)
    yield CounterMetricFamily("kvtierd_loads_past_deadline", "Requests that stopped waiting for their lookup or "
                              "loads at the deadline (a share of the planner's recompute estimate for a lookup, "
                              "all of it for loads), or did not wait for a lookup the tiers lately answered "
                              "slower, and recomputed instead.",
                              tiers.transfer_stats.loads_past_deadline)


def _per_tier(name: str, doc: str, kind: type, value: float) -> Metric:
    family = kind(name, doc, labels=["tier"])
    family.add_metric([TIER], value)
    return family


def _fragmentation(eng: LLMEngine) -> float:
    """Only a sequence's last page can be partly used; shared pages count once per sequence."""
    allocated = used = 0
    for req in eng.scheduler.running:
        table = eng.kv.table(req.request_id)
        allocated += len(table.block_ids) * table.block_size
        used += table.num_tokens
    return (allocated - used) / allocated if allocated else 0.0
