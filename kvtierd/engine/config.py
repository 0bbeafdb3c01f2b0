"""Engine settings: the KV budget, the batching limits and the prefix cache's policy."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.cache.block_hash import HASH_FUNCTIONS
from kvtierd.cache.eviction import EVICTION_POLICIES
from kvtierd.tiers.config import TierConfig

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV page
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # device KV pool size
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_num_seqs: int = 64  # running requests at once
    max_model_len: int | None = None  # defaults to the model's context window
    enable_prefix_caching: bool = True  # reuse cached pages across requests (off: every prompt is computed)
    eviction_policy: str = "lru"  # which idle cached page is reused first: lru, lfu or cost (cache/eviction.py)
    prefix_ttl_s: float = 0.0  # an idle cached page expires after this long unused (0: never)
    prefix_min_hits_per_hour: float = 0.0  # ... or when its hit rate stays below this after an hour (0: off)
    session_idle_ttl_s: float = 0.0  # a session's context pool goes after this long idle (0: never)
    hash_algorithm: str = "md5"  # chained block hashes: md5, sha256 or xxh3-128 (cache/block_hash.py)
    tiers: TierConfig | None = None  # host and disk tiers below the device (None: the device only)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}")
        if self.hash_algorithm not in HASH_FUNCTIONS:
            raise ValueError(f"hash_algorithm must be one of {', '.join(HASH_FUNCTIONS)}")
        if min(self.prefix_ttl_s, self.prefix_min_hits_per_hour, self.session_idle_ttl_s) < 0:
            raise ValueError("prefix_ttl_s, prefix_min_hits_per_hour and session_idle_ttl_s must be 0 (off) or positive")
