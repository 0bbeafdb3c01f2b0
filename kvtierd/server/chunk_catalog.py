"""The SQL chunk catalog: which disk-tier chunks hold each session's KV; its reconciliation with LMDB,
and the warm-up of recent sessions at startup.

A session turn's chunks are written to LMDB by the disk writer (marked cataloged, in the value's own
transaction) while the turn itself, with one catalog row per chunk, is written to SQL in one
transaction (`record_turn`). Either may be lost alone: a crash between the two, a dropped write, an
eviction, a session deleted while this daemon was down (its rows go with it, its values stay). At
startup `reconcile_disk_tier` settles them, before the socket serves:

    LMDB value marked cataloged, no row names it  -> the value is deleted (an orphan value)
    row naming a key LMDB does not hold           -> the row is deleted (an orphan row)

Values the disk tier holds for other reasons (evicted prefixes, the shutdown flush) are plain cache,
left to its LRU. Rows carry the store's name (`tiers/store_name.py`), so daemons sharing one
PostgreSQL each settle their own.

Then `warm_recent_sessions` copies the cataloged chunks of the `[tiers] warm_sessions` most recently
used sessions from disk to the host tier, in the background: their next turns after a restart load
from memory.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtierd.storage.store_errors import SessionStoreError

if TYPE_CHECKING:  # the state holds this module's result
    from kvtierd.server.state import DaemonState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CatalogReconciliation:
    orphan_values: int  # LMDB values no catalog row named: deleted
    orphan_rows: int  # catalog rows whose value LMDB did not hold: deleted


async def reconcile_disk_tier(state: DaemonState) -> CatalogReconciliation | None:
    """Removes the orphans on either side (see the module's note); None when there is no disk tier or the
    session database cannot be read now (then nothing is removed)."""
    tiers, name = state.engine.engine.tiers, state.chunk_store
    if name is None:
        return None
    try:
        cataloged = await state.db(state.store.cataloged_chunks, name)
        settled = await state.db(tiers.reconcile, cataloged)
        if settled is None:
            return None
        rows = await state.db(state.store.uncatalog_chunks, name, list(settled.missing_keys))
    except SessionStoreError as e:
        log.warning("disk KV tier not reconciled with the session catalog: %s", e)
        return None
    result = CatalogReconciliation(settled.orphan_values, rows)
    log.info("disk KV tier reconciled with the session catalog: %d orphan value(s) and %d orphan row(s) "
             "removed, %d chunk(s) cataloged", result.orphan_values, result.orphan_rows,
             len(cataloged) - len(settled.missing_keys))
    return result


async def warm_recent_sessions(state: DaemonState) -> None:
    """Starts copying the recent sessions' disk chunks to the host tier (see the module's note); returns at
    once, and logs how many came up when they have."""
    tiers, num_sessions = state.engine.engine.tiers, state.settings.warm_sessions
    if not num_sessions or state.chunk_store is None or tiers.host is None:
        return
    try:
        keys = await state.db(state.store.recent_session_chunks, state.chunk_store, num_sessions)
    except SessionStoreError as e:
        log.warning("recent sessions not warmed into the host tier: %s", e)
        return
    if not keys:
        return
    t0 = time.monotonic()

    def report(done: Future) -> None:
        if done.exception() is None:
            log.info("%d chunk(s) of recent sessions warmed into the host tier in %.2f s", done.result(),
                     time.monotonic() - t0)

    tiers.warm(keys).add_done_callback(report)
