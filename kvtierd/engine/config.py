"""Engine settings: the KV budget, the batching limits, the prefix cache's policy and QoS."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtierd.cache.block_hash import HASH_FUNCTIONS
from kvtierd.cache.eviction import EVICTION_POLICIES
from kvtierd.tiers.config import TierConfig

DEFAULT_KV_CACHE_BYTES = 1 << 30
QOS_CLASSES = ("high", "normal", "low")  # highest first


@dataclass(frozen=True, slots=True)
class QosConfig:
    """QoS classes, the reserved region and the pin budget (docs/ARCHITECTURE.md, "QoS and pins")."""

    weights: dict[str, float] = field(default_factory=lambda: {"high": 8.0, "normal": 4.0, "low": 1.0})
    # Latency target per class: the longest a request waits for admission (0: no limit); past it, it is
    # refused. No limit for an engine built directly (benchmarks, `kvtierd generate`); the daemon's
    # `[qos] max_queue_s` sets one.
    max_queue_s: dict[str, float] = field(default_factory=lambda: {"high": 0.0, "normal": 0.0, "low": 0.0})
    aging_s: float = 10.0  # a waiting request's weight grows by 1 every aging_s seconds
    # Load shedding: while a high request has waited this long unadmitted, queued low requests are refused
    # (0: off). Set it below high's max_queue_s, or high times out before low is shed.
    shed_low_after_s: float = 0.0
    reserved_share: float = 0.0  # of the device pages, only high may take (the start size when it resizes)
    reserved_min_share: float = 0.0  # floor of the resizing reserve
    reserved_max_share: float = 0.5  # ceiling of the resizing reserve
    reserved_window_s: float = 0.0  # resize from the p99 of high's page use over this window (0: fixed)
    pin_share: float = 0.25  # of the device pages, pins may hold
    # Eviction takes first from the tenants above their weighted share of the cached pages (cache/cache_shares.py);
    # a tenant not named weighs 1. Off: one policy orders every tenant's pages.
    cache_shares: bool = True
    tenant_cache_weights: dict[str, float] = field(default_factory=dict)
    # Bytes of host-tier chunks a tenant may hold ("*": any tenant not named); at it, its own oldest chunk goes.
    tenant_host_bytes: dict[str, int] = field(default_factory=dict)
    # Bytes of disk-tier values a tenant may hold; past it, its own oldest values go (never another tenant's).
    tenant_disk_bytes: dict[str, int] = field(default_factory=dict)
    # Bytes of remote-tier values a tenant may hold, counted in Redis for the whole fleet; past it, its own oldest.
    tenant_remote_bytes: dict[str, int] = field(default_factory=dict)
    # Time-bounded steps (engine/scheduler.py): while a request of a class is present, lower classes' work in a
    # step is cut so the step's planned cost stays within this many ms (None: auto, the class's own work plus
    # what a step of one decode costs; 0: off). Low's has no effect: no class is below it. Off for an engine built directly; the
    # daemon's `[qos] step_budget_ms` sets it.
    step_budget_ms: dict[str, float | None] = field(default_factory=lambda: {"high": 0.0, "normal": 0.0, "low": 0.0})
    # A class counts as present this long after its last request left: a request arriving mid-step waits for the
    # step in flight, so steps stay bounded between the requests of a stream.
    step_budget_hold_s: float = 5.0

    def __post_init__(self) -> None:
        if set(self.step_budget_ms) != set(QOS_CLASSES) or \
                any(v is not None and not v >= 0 for v in self.step_budget_ms.values()):
            raise ValueError(f"qos step_budget_ms needs auto (None) or a number >= 0 for each of {', '.join(QOS_CLASSES)}")
        if self.step_budget_hold_s < 0:
            raise ValueError("qos step_budget_hold_s must be 0 or positive")
        for name, table in (("weights", self.weights), ("max_queue_s", self.max_queue_s)):
            if set(table) != set(QOS_CLASSES) or min(table.values()) < 0:
                raise ValueError(f"qos {name} needs a value >= 0 for each of {', '.join(QOS_CLASSES)}")
        if min(self.weights.values()) <= 0 or self.aging_s <= 0:
            raise ValueError("qos weights and aging_s must be positive")
        if any(not w > 0 for w in self.tenant_cache_weights.values()):
            raise ValueError("qos tenant_cache_weights must be positive")
        if self.shed_low_after_s < 0:
            raise ValueError("qos shed_low_after_s must be 0 (off) or positive")
        shares = (self.reserved_min_share, self.reserved_share, self.reserved_max_share)
        if not 0 <= shares[0] <= shares[1] <= shares[2] <= 1:
            raise ValueError("qos reserved shares need 0 <= reserved_min_share <= reserved_share "
                             "<= reserved_max_share <= 1")
        if not 0 <= self.pin_share <= 1 or self.reserved_window_s < 0 or \
                self.reserved_max_share + self.pin_share > 1:
            raise ValueError("qos pin_share must be in [0, 1], with reserved_max_share + pin_share <= 1, and "
                             "reserved_window_s >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # device KV pool size
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 64  # running requests at once
    # While requests decode, a prompt's prefill beside them (of their class or a lower one) adds at most this
    # share to their step's predicted cost: its chunks are cut to fit, a token at least (engine/scheduler.py).
    # 0: off, a chunk is as large as max_num_batched_tokens allows.
    prefill_share: float = 0.0
    # While requests decode, a prompt's prefill beside them (of their class or a lower one) goes in chunks of at
    # most this many tokens: the streams' gap is one such chunk's step, not a whole budget's (0: off, for an engine
    # built directly; the daemon's [engine] prefill_chunk_beside_decodes sets it).
    prefill_chunk_beside_decodes: int = 0
    max_model_len: int | None = None  # defaults to the model's context window
    enable_prefix_caching: bool = True  # reuse cached pages across requests (off: every prompt is computed)
    eviction_policy: str = "lru"  # which idle cached page is reused first: lru, lfu or cost (cache/eviction.py)
    prefix_ttl_s: float = 0.0  # an idle cached page expires after this long unused (0: never)
    prefix_min_hits_per_hour: float = 0.0  # ... or when its hit rate stays below this after an hour (0: off)
    session_idle_ttl_s: float = 0.0  # a session's context pool goes after this long idle (0: never)
    hash_algorithm: str = "md5"  # chained block hashes: md5, sha256 or xxh3-128 (cache/block_hash.py)
    # Compact the pages when the engine goes idle with a fragmentation ratio at least this (0: never;
    # cache/fragmentation.py). Off for an engine built directly; the daemon's [cache] compact_threshold sets it.
    compact_threshold: float = 0.0
    tiers: TierConfig | None = None  # host and disk tiers below the device (None: the device only)
    qos: QosConfig = field(default_factory=QosConfig)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if not self.prefill_share >= 0:
            raise ValueError("prefill_share must be 0 (off) or positive")
        if self.prefill_chunk_beside_decodes < 0:
            raise ValueError("prefill_chunk_beside_decodes must be 0 (off) or positive")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}")
        if self.hash_algorithm not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algorithm must be one of {', '.join(HASH_FUNCTIONS)}")
        if min(self.prefix_ttl_s, self.prefix_min_hits_per_hour, self.session_idle_ttl_s) < 0:
            raise ValueError("prefix_ttl_s, prefix_min_hits_per_hour and session_idle_ttl_s must be 0 (off) or positive")
        if not 0 <= self.compact_threshold <= 1:
            raise ValueError("compact_threshold must be a ratio between 0 (off) and 1")
