"""What the lower tiers are given: budgets, chunk size, codec, where the disk store lives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtierd.storage.codecs import CODEC_NAMES

# What a capacity eviction writes to disk (the host tier takes every evicted chunk):
#   reused  chunks with a page hit at least once (sessions are written as their turns end anyway)
#   all     every evicted chunk
DISK_ADMISSIONS = ("reused", "all")


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_bytes: int = 2 << 30  # host slab budget (0: no host tier)
    disk_bytes: int = 16 << 30  # LMDB map size (0: no disk tier)
    disk_path: Path | None = None  # an existing directory for the LMDB store (None: no disk tier)
    chunk_pages: int = 16  # pages per stored chunk
    disk_codec: str = "zstd-planes"
    disk_admission: str = "reused"
    max_pending_disk_bytes: int = 256 << 20  # chunk copies waiting for the disk writer; past it new ones are dropped

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("host_bytes and disk_bytes must be 0 (off) or positive")
        if self.chunk_pages < 1:
            raise ValueError(f"chunk_pages must be at least 1, got {self.chunk_pages}")
        if self.disk_codec not in CODEC_NAMES:
            raise ValueError(f"disk_codec must be one of {', '.join(CODEC_NAMES)}")
        if self.disk_admission not in DISK_ADMISSIONS:
            raise ValueError(f"disk_admission must be one of {', '.join(DISK_ADMISSIONS)}")
