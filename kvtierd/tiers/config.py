"""What the lower tiers are given: budgets, chunk size, codecs, where the disk store lives, the fleet's Redis."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtierd.storage.codecs import CODEC_NAMES

# What a capacity eviction writes to disk (the host tier takes every evicted chunk):
#   reused  chunks with a page hit at least once (sessions are written as their turns end anyway)
#   all     every evicted chunk
DISK_ADMISSIONS = ("reused", "all")
# What the remote (fleet) tier shares besides evicted chunks the disk would take and session turns:
#   all       the full chunks of every finished request: a document computed on one host serves all
#   sessions  session turns only
REMOTE_ADMISSIONS = ("all", "sessions")
# A new request waits for the lower tiers' lookup this share of the estimate of recomputing its prompt, at most:
# what a request waits, a miss waits too (a Redis with a delay). 0: only an answer already in.
LOOKUP_WAIT_SHARE = 0.1
# A tier's codec: one of CODEC_NAMES, or "auto" (`resolve_codec`).
TIER_CODECS = ("auto", *CODEC_NAMES)


def resolve_codec(codec: str, tier: str) -> str:
    """The codec a tier uses. "auto" on disk: raw. zstd over byte planes saves a third of 16-bit KV's bytes
    (a fifth of 32-bit KV's), but decodes at ~0.5 GB/s a core and encodes at ~0.2, while an SSD reads raw
    chunks at 1-3 GB/s: on disk it cost restores and stores more than the bytes it saved (`kvtierd bench
    tiers` measures both; a slow disk may want zstd-planes). "auto" for the fleet: zstd-planes, since the
    shared server's memory and the network are what is short there."""
    if codec != "auto":
        return codec
    return "raw" if tier == "disk" else "zstd-planes"


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """A Valkey/Redis shared by a fleet (storage/redis_store.py)."""

    url: str  # redis://, rediss://, unix://, redis+sentinel://, redis+cluster://
    secret: bytes  # seals every value (HMAC): hosts without it cannot plant KV
    fleet: str = "default"  # hosts share what they store under one fleet name
    ttl_s: int = 86400
    connect_timeout_ms: int = 200
    op_timeout_ms: int = 500
    codec: str = "auto"
    admission: str = "all"
    directory: bool = False  # follow what the fleet stores (storage/redis_directory.py); the daemon's default: on

    def __post_init__(self) -> None:
        if self.admission not in REMOTE_ADMISSIONS:
            raise ValueError(f"remote admission must be one of {', '.join(REMOTE_ADMISSIONS)}")
        if self.codec not in TIER_CODECS:
            raise ValueError(f"remote codec must be one of {', '.join(TIER_CODECS)}")


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_bytes: int = 2 << 30  # host slab budget (0: no host tier)
    disk_bytes: int = 16 << 30  # LMDB map size (0: no disk tier)
    disk_path: Path | None = None  # an existing directory for the LMDB store (None: no disk tier)
    chunk_pages: int = 16  # pages per stored chunk
    disk_codec: str = "auto"
    disk_admission: str = "reused"
    max_pending_disk_bytes: int = 256 << 20  # chunk copies waiting for a writer; past it new ones are dropped
    store_defer_ms: int = 2000  # writes and a turn's copy wait while the engine has steps, this long at most (0: never)
    lookup_wait_share: float = LOOKUP_WAIT_SHARE
    remote: RemoteConfig | None = None  # the fleet's shared tier (None: none)

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("host_bytes and disk_bytes must be 0 (off) or positive")
        if self.store_defer_ms < 0:
            raise ValueError(f"store_defer_ms must be 0 (never defer) or positive, got {self.store_defer_ms}")
        if self.lookup_wait_share < 0:
            raise ValueError(f"lookup_wait_share must be 0 or positive, got {self.lookup_wait_share}")
        if self.chunk_pages < 1:
            raise ValueError(f"chunk_pages must be at least 1, got {self.chunk_pages}")
        if self.disk_codec not in TIER_CODECS:
            raise ValueError(f"disk_codec must be one of {', '.join(TIER_CODECS)}")
        if self.disk_admission not in DISK_ADMISSIONS:
            raise ValueError(f"disk_admission must be one of {', '.join(DISK_ADMISSIONS)}")
