"""The tier backends a `TierConfig` asks for, opened: a tier turned off, or whose store cannot open, is absent
and says why (the daemon then serves with the others)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.redis_keyspace import RedisKeyspace
from kvtierd.storage.redis_store import RedisStore
from kvtierd.storage.store_errors import StoreUnavailableError
from kvtierd.tiers.config import TierConfig, resolve_codec
from kvtierd.tiers.disk_backend import DiskBackend
from kvtierd.tiers.epoch import Epoch
from kvtierd.tiers.host_backend import HostBackend
from kvtierd.tiers.page_copy import PageCopier
from kvtierd.tiers.remote_backend import RemoteBackend
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts
from kvtierd.tiers.transfer import TransferStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenedTiers:
    epoch: Epoch  # the local one: in the disk store's directory when there is one (host and disk keys mix it in)
    host: HostBackend | None = None
    disk: DiskBackend | None = None
    remote: RemoteBackend | None = None  # None: none configured, or none at all
    off: dict[Tier, str] = field(default_factory=dict)  # why host or disk is not there


def open_backends(config: TierConfig, pages: PageCopier, counts: dict[Tier, TierCounts],
                  transfer_stats: TransferStats, model_fingerprint: str) -> OpenedTiers:
    g, off = pages.geometry, {}
    disk_store = _open_disk(config, off)
    opened = OpenedTiers(Epoch(config.disk_path if disk_store is not None else None), off=off)
    if disk_store is not None:
        opened.disk = DiskBackend(disk_store, resolve_codec(config.disk_codec, Tier.DISK),
                                  config.max_pending_disk_bytes, pages, opened.epoch, counts[Tier.DISK], transfer_stats,
                                  config.store_defer_ms / 1e3)
    if not config.host_bytes:
        off[Tier.HOST] = "off: host_bytes is 0"
    else:
        try:
            opened.host = HostBackend(config.host_bytes, config.chunk_pages, pages, opened.epoch, counts[Tier.HOST],
                                      transfer_stats)
        except ValueError as e:  # a budget under one chunk
            off[Tier.HOST] = str(e)
            log.warning("serving without the host KV tier: %s", e)
    if (r := config.remote) is not None:
        keyspace = RedisKeyspace(r.fleet, model_fingerprint, g, config.chunk_pages)
        store = RedisStore(r.url, keyspace, r.secret, ttl_s=r.ttl_s, connect_timeout_ms=r.connect_timeout_ms,
                           op_timeout_ms=r.op_timeout_ms)
        if r.directory:
            store.follow()
        opened.remote = RemoteBackend(store, resolve_codec(r.codec, Tier.REMOTE),
                                      config.max_pending_disk_bytes, pages, counts[Tier.REMOTE], transfer_stats,
                                      config.store_defer_ms / 1e3)
    return opened


def _open_disk(config: TierConfig, off: dict[Tier, str]) -> DiskStore | None:
    if not config.disk_bytes or config.disk_path is None:
        off[Tier.DISK] = "off: disk_bytes is 0" if not config.disk_bytes else "off: no directory given"
        return None
    try:
        return DiskStore(config.disk_path, map_size=config.disk_bytes)
    except StoreUnavailableError as e:
        off[Tier.DISK] = str(e)
        log.warning("serving without the disk KV tier: %s", e)
        return None
