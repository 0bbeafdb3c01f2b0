"""Requests whose prefix is being loaded from the lower tiers: the page side of a two-phase load.

    waiting --begin--> loading --(every load done, or its deadline passed)--> ready --finish--> admitted
                          \\--cancel (client hung up, refused)--> gone: pages released, loads abandoned

`begin` plans the chunks found below (the restore planner: load or recompute),
takes fresh device pages for each chunk to load, or joins a load of the same
chunk that another request started, and submits the rest to the tier
manager's transfer workers. Meanwhile the request holds its device prefix
pages and each load holds its destination pages, so neither is evicted or
written; the engine goes on stepping the others. `finish` indexes the loaded
pages in chain order (a page whose predecessor failed to load stays
unindexed: no lookup could reach it), then lets go of them: the request's
admission adopts them from the prefix index like any cached page, and
computes the rest.

A load's deadline is the planner's estimate of recomputing what it loads:
past it the request stops waiting and recomputes what has not arrived (the
late loads are abandoned; their pages come back when their copy ends). An
invalidation while loading (`epoch` changes) drops what was loaded: it may be
what was invalidated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtierd.cache.block_pool import BlockPool
from kvtierd.tiers.restore_planner import ChunkCost, RestorePlan
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.transfer import ChunkLoad


@dataclass(eq=False, slots=True)
class LoadTicket:
    """One request's loads."""

    device_blocks: list[int]  # its prefix pages on the device, held while it loads
    device_hashes: list[bytes]
    loads: list[ChunkLoad]  # in chain order
    plan: RestorePlan
    high: bool
    deadline: float | None  # monotonic; None: the planner has no estimate (the stores' timeouts bound it)
    epoch: int  # the cache's invalidation count when it began
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # filled by finish: tokens loaded, by tier
    chain_blocks: list[int] = field(default_factory=list)  # filled by finish: the indexed prefix, device + loaded
    chain_hashes: list[bytes] = field(default_factory=list)


class Loading:
    def __init__(self, pool: BlockPool, tiers: TierManager, block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._tiers = tiers
        self._transfers = tiers.transfers
        self._block_size = block_size
        self._clock = clock
        self._tickets: dict[str, LoadTicket] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tickets

    def begin(self, seq_id: str, block_ids: list[int], block_hashes: list[bytes], below: list,
              high: bool, epoch: int, before_write: Callable[[], None]) -> RestorePlan:
        """Starts loading the chunks `below` that continue the device pages `block_ids`, under a ticket for
        `seq_id` unless nothing is loaded (the planner prefers recomputing, or there are no pages for the
        first chunk). Returns the restore plan.
        `before_write` runs after pages were taken and before any load writes into them (evicted pages
        are saved below first)."""
        plan = self._tiers.planner.plan(self._costs(len(block_ids), below))
        self._pool.touch(block_ids, high)  # before any allocation: they are idle, the allocation could take them
        loads: list[ChunkLoad] = []
        on_device = len(block_ids)
        for found in below[: plan.num_chunks]:
            skip = on_device - found.span.first_page if found is below[0] else 0
            load = self._transfers.find(found, skip)
            if load is not None:
                self._transfers.join(load, seq_id)
            else:
                pages = self._pool.allocate(found.span.num_pages - skip, high)
                if pages is None:
                    break
                before_write()
                load = self._transfers.submit(seq_id, found, skip, pages, high)
            loads.append(load)
        if not loads:
            self._pool.release(block_ids, high)
        else:
            deadline = None if plan.recompute_s is None else self._clock() + plan.recompute_s
            self._tickets[seq_id] = LoadTicket(list(block_ids), list(block_hashes), loads, plan, high, deadline, epoch)
        return plan

    def ready(self, seq_id: str) -> bool:
        """Every load of its ticket finished, or its deadline passed."""
        t = self._tickets[seq_id]
        return all(load.done for load in t.loads) or (t.deadline is not None and self._clock() > t.deadline)

    def finish(self, seq_id: str, epoch: int) -> LoadTicket:
        """Ends a ready ticket: indexes what arrived in order (unless an invalidation came in between) and
        lets go of every page it held. Call right before the request adopts its prefix."""
        t = self._tickets.pop(seq_id)
        blocks, hashes = list(t.device_blocks), list(t.device_hashes)
        for load in t.loads:
            tier = load.tier() if load.done else None
            if tier is None or epoch != t.epoch:
                if not load.done:
                    self._transfers.stats.loads_past_deadline += 1
                break
            if not self._index(load, blocks, hashes):
                break
            t.tokens_by_tier[tier] = t.tokens_by_tier.get(tier, 0) + len(load.block_ids) * self._block_size
        t.chain_blocks, t.chain_hashes = blocks, hashes
        self._let_go(seq_id, t)
        return t

    def cancel(self, seq_id: str) -> None:
        """The request is gone: its pages are released and the loads only it waited for abandoned."""
        t = self._tickets.pop(seq_id, None)
        if t is not None:
            self._let_go(seq_id, t)

    def reap(self) -> None:
        """Releases the pages of abandoned loads whose copy has ended; call between steps."""
        for load in self._transfers.reap():
            self._pool.release(load.block_ids, load.high)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a load finishes, at most until the nearest deadline or `timeout_s`."""
        deadlines = [t.deadline for t in self._tickets.values() if t.deadline is not None]
        if deadlines:
            timeout_s = max(0.0, min(timeout_s, min(deadlines) - self._clock()))
        self._transfers.wait(timeout_s)

    def _index(self, load: ChunkLoad, blocks: list[int], hashes: list[bytes]) -> bool:
        """Indexes a loaded chunk's pages after the chain `blocks`, extending it; False when one could not be
        (its chain's head went meanwhile: no lookup could reach the rest)."""
        span = load.found.span
        for i, b in enumerate(load.block_ids, start=load.skip):
            depth = span.first_page + i
            self._pool.cache(b, span.block_hashes[i], span.page_tokens(i), span.namespace, depth,
                             hashes[-1] if depth else None)
            indexed = self._pool.block_of(span.block_hashes[i])  # another page may have had the hash first
            if indexed is None:
                return False
            self._pool.hits[indexed] = max(1, self._pool.hits.get(indexed, 0))  # asked for again: reused
            blocks.append(indexed)
            hashes.append(span.block_hashes[i])
        return True

    def _let_go(self, seq_id: str, t: LoadTicket) -> None:
        for load in t.loads:
            if self._transfers.leave(load, seq_id):
                self._pool.release(load.block_ids, load.high)
        self._pool.release(t.device_blocks, t.high)

    def _costs(self, on_device: int, below: list) -> list[ChunkCost]:
        """What loading each found chunk would copy, and what computing it would take, past the device's pages."""
        costs = []
        for found in below:
            pages = found.span.first_page + found.span.num_pages - max(on_device, found.span.first_page)
            on_device = found.span.first_page + found.span.num_pages
            costs.append(ChunkCost(found.tier, pages * self._tiers.bytes_per_page, pages * self._block_size))
        return costs
