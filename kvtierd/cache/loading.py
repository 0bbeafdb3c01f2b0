"""Requests whose prefix is being loaded from the lower tiers: the page side of a two-phase load.

    arrival --look_ahead--> (its lookup runs on a lookup worker while it queues)
    waiting --look_up--> looking up --(answer: start loads)--> loading --(every load done)--> ready --finish--> queued
                |                \\--(nothing below)------------------------------------------/
                \\--(answer there already)--> loading, or admitted at once when nothing is below
      loading, no pages for its first load --(pages freed: checked each step)--> loading
      any state before queued --(deadline passed)--> ready: what has not arrived is recomputed
      any state before queued --cancel (client hung up, refused)--> gone: pages released, loads abandoned

Lookups run on the transfer queue's lookup workers, never on the step: a
Redis that answers slowly or not at all holds the looking-up request (up to
its deadline), not the others. A request's lookup starts when it arrives
(`look_ahead`), so by its admission the answer is usually there; if its device
hit changed meanwhile, it looks up again. `begin` plans the chunks found below (the restore planner: load or recompute),
takes fresh device pages for each chunk to load, or joins a load of the same
chunk that another request started, and submits the rest to the tier
manager's transfer workers, LOADS_AHEAD unfinished at a time (the next
chunk's pages are taken as a load ends, `ready`); the values of the others
are read ahead where round trips are slow (a far or slow Redis:
tiers/read_ahead.py). Meanwhile the request holds its device prefix
pages and each load holds its destination pages, so neither is evicted or
written; the engine goes on stepping the others. `finish` indexes the loaded
pages in chain order (a page whose predecessor failed to load stays
unindexed: no lookup could reach it), then lets go of every page the ticket
held: the request queues holding none, and its admission adopts them from the
prefix index like any cached page (what was evicted meanwhile is recomputed),
and computes the rest.

A load's deadline is the planner's estimate of recomputing what it loads,
from when the loads start (what the lookup took is spent either way; counted
from the lookup, a lookup slowed by a busy machine left a fleet load no time,
and the request recomputed what had been found):
past it the request stops waiting and recomputes what has not arrived (the
late loads are abandoned: they stop at their next slice, and their pages come
back then). A
lookup's answer is waited for a share of the estimate of recomputing the
request's pending tokens (the tiers' `lookup_wait_share`, a tenth by
default: whatever a request waits for a lookup, a miss waits too; waiting
the whole estimate, a slow Redis added over a second to every new prompt's
TTFT), and not at all when the lookups that answered lately took longer
than that (a slow Redis): the request computes at once, and its lookup's
answer goes unread. A slow Redis loads in about two of its round trips
(its values read ahead), so a far fleet's long prompts gain from a larger
share (README: `lookup_wait_share`). An invalidation while loading (`epoch` changes) drops
what was loaded: it may be what was invalidated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from kvtierd.cache.block_pool import BlockPool
from kvtierd.tiers.chunk import FoundChunk
from kvtierd.tiers.restore_planner import LOADS_AHEAD, NOTHING_BELOW, ChunkCost, RestorePlan
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.transfer import ChunkLoad

log = logging.getLogger(__name__)

# Loads yield to the running requests' steps (tiers/background_work.py) during this share of the time from the
# request's arrival to its deadline, and go at full speed after it: paced for as long as the deadline allowed, a
# slow fleet load ran past it and its request recomputed in full chunks (`bench stall`: 0.8 s steps). At half, a
# fleet load within the steps' lends (0.8-1 s on 2 cores, its deadline ~1.8 s) ran its last chunks beside them.
PACED_DEADLINE_SHARE = 0.8


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
    started: float = 0.0  # monotonic: when its lookup, then its loads, began (its deadline counts from there)
    lookup: Future | None = None  # the lower tiers' lookup, until its answer started the loads
    unstarted: list[FoundChunk] = field(default_factory=list)  # planned, not submitted yet (LOADS_AHEAD, pages)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # filled by finish: tokens loaded, by tier
    chain_blocks: list[int] = field(default_factory=list)  # filled by finish: the indexed prefix, device + loaded
    chain_hashes: list[bytes] = field(default_factory=list)

    def tokens_kept(self, num_tokens: int, block_size: int) -> dict[str, int]:
        """`tokens_by_tier` of what a prefix of `num_tokens` (adopted after it arrived) still holds: loaded
        pages evicted before the adoption count for no tier (they are recomputed)."""
        left = num_tokens - len(self.device_blocks) * block_size
        kept = {}
        for tier, tokens in self.tokens_by_tier.items():  # in chain order
            kept[tier] = max(0, min(tokens, left))
            left -= kept[tier]
        return kept


class Loading:
    def __init__(self, pool: BlockPool, tiers: TierManager, block_size: int, save_evicted: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._save_evicted = save_evicted
        self._tiers = tiers
        self._transfers = tiers.transfers
        self._block_size = block_size
        self._clock = clock
        self._tickets: dict[str, LoadTicket] = {}
        self._early: dict[str, tuple[int, Future]] = {}  # request -> (its device pages then, its arrival's lookup)

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tickets

    def look_ahead(self, seq_id: str, start: int, lookup: Callable[[], list[FoundChunk]]) -> None:
        """Starts a request's lookup of the lower tiers as it arrives (the device holding its first `start`
        pages), on a lookup worker: by its admission the answer is usually there."""
        self._early[seq_id] = (start, self._transfers.look_up(lookup))

    def forget(self, seq_id: str) -> None:
        """Drops a request's early lookup (it left, or its admission no longer needs it)."""
        self._early.pop(seq_id, None)

    def look_up(self, seq_id: str, block_ids: list[int], block_hashes: list[bytes],
                lookup: Callable[[], list[FoundChunk]], pending_tokens: int, high: bool, epoch: int) -> RestorePlan:
        """Finds what the lower tiers hold past the device pages `block_ids`: the request's early lookup when it
        started from the same page, else a new one, on a lookup worker. An answer already there starts the loads
        at once; otherwise `seq_id` waits under a ticket (holding its device pages) until `ready` finds the
        answer and starts them. It waits for the answer `lookup_wait_share` of the planner's estimate of computing
        its `pending_tokens` (not at all when lookups lately took longer); its loads, the whole estimate (from
        the same start).
        `seq_id in self` after it when it is looking up or loading; the plan of an answer already there."""
        start, future = self._early.pop(seq_id, (None, None))
        if start != len(block_ids):
            # Pages evicted in this step (a request just preempted: its own) are saved below before it looks.
            self._save_evicted()
            future = self._transfers.look_up(lookup)
        if future.done():
            found = _found(future)
            return self.begin(seq_id, block_ids, block_hashes, found, high, epoch, wait_for_pages=True) \
                if found else NOTHING_BELOW
        recompute_s = self._tiers.planner.recompute_s(pending_tokens)
        typical = self._transfers.lookup_s
        share = self._tiers.config.lookup_wait_share
        if recompute_s is not None and typical is not None and typical > share * recompute_s:
            # Lookups lately took longer than it would wait: it recomputes now, its answer unread.
            self._transfers.stats.loads_past_deadline += 1
            return NOTHING_BELOW
        now = self._clock()
        self._pool.touch(block_ids, high)
        self._tickets[seq_id] = LoadTicket(list(block_ids), list(block_hashes), [], NOTHING_BELOW, high,
                                           None if recompute_s is None else now + share * recompute_s,
                                           epoch, started=now, lookup=future)
        return NOTHING_BELOW

    def begin(self, seq_id: str, block_ids: list[int], block_hashes: list[bytes], below: list,
              high: bool, epoch: int, wait_for_pages: bool = False) -> RestorePlan:
        """Starts loading the chunks `below` that continue the device pages `block_ids`, under a ticket for
        `seq_id` unless nothing is loaded (the planner prefers recomputing, or there are no pages for the
        first chunk and not `wait_for_pages`: the scheduler's requests wait, tools do not). Returns the plan."""
        self._pool.touch(block_ids, high)  # before any allocation: they are idle, the allocation could take them
        t = LoadTicket(list(block_ids), list(block_hashes), [], NOTHING_BELOW, high, None, epoch, started=self._clock())
        self._start_loads(seq_id, t, below)
        if not wait_for_pages and not t.loads:
            t.unstarted = []
        if t.loads or t.unstarted:
            self._tickets[seq_id] = t
        else:
            self._pool.release(block_ids, high)
        return t.plan

    def _start_loads(self, seq_id: str, t: LoadTicket, below: list[FoundChunk]) -> None:
        """Plans the found chunks and submits the loads the plan keeps, as pages allow; the deadline is the
        planner's estimate of recomputing them, from now."""
        t.plan = self._tiers.planner.plan(self._costs(len(t.device_blocks), below))
        t.started = self._clock()
        t.deadline = None if t.plan.recompute_s is None else t.started + t.plan.recompute_s
        t.unstarted = below[: t.plan.num_chunks]
        self._tiers.read_ahead(t.unstarted[LOADS_AHEAD:])  # the values of those that wait for their turn
        self._submit_loads(seq_id, t)

    def _submit_loads(self, seq_id: str, t: LoadTicket) -> None:
        """Submits the ticket's unstarted loads in chain order, LOADS_AHEAD unfinished at a time, as pages
        allow. With no pages for the first, none starts and the ticket waits for pages until its deadline
        (without one it does not wait): a request back from preemption finds the pages it lost below, but the
        others took the room it had. Past a chunk with no pages, the rest is recomputed. Evicted pages are
        saved below before any load writes into them."""
        on_device = len(t.device_blocks)
        while t.unstarted and sum(not load.done for load in t.loads) < LOADS_AHEAD:
            found = t.unstarted[0]
            skip = on_device - found.span.first_page if not t.loads else 0
            load = self._transfers.find(found, skip)
            if load is not None:
                self._transfers.join(load, seq_id)
            else:
                pages = self._pool.allocate(found.span.num_pages - skip, t.high)
                if pages is None:
                    if t.loads or t.deadline is None:
                        t.unstarted = []
                    return
                self._save_evicted()
                pace_until = None if t.deadline is None else \
                    t.started + PACED_DEADLINE_SHARE * (t.deadline - t.started)
                load = self._transfers.submit(seq_id, found, skip, pages, t.high, pace_until)
            t.loads.append(load)
            t.unstarted.pop(0)

    def ready(self, seq_id: str) -> bool:
        """Its lookup answered and every load it started finished, or its deadline passed. Call between steps:
        a lookup that answered starts its loads here."""
        t = self._tickets[seq_id]
        if t.lookup is not None and t.lookup.done():  # its plan is made even when late: the reply reports it
            found, t.lookup = _found(t.lookup), None
            if found:
                self._start_loads(seq_id, t, found)
        elif t.unstarted:  # the next loads as the last ones end, or pages freed since the last call
            self._submit_loads(seq_id, t)
        if t.deadline is not None and self._clock() > t.deadline:
            return True
        return t.lookup is None and not t.unstarted and all(load.done for load in t.loads)

    def finish(self, seq_id: str, epoch: int) -> LoadTicket:
        """Ends a ready ticket: indexes what arrived in order (unless an invalidation came in between) and
        lets go of every page it held (the request's admission adopts them from the index). Call between
        steps."""
        t = self._tickets.pop(seq_id)
        blocks, hashes = list(t.device_blocks), list(t.device_hashes)
        # Its deadline passed while looking up, before all its loads were submitted, or before they ended: it
        # computes what did not arrive.
        late = t.lookup is not None or bool(t.unstarted) or not all(load.done for load in t.loads)
        self._transfers.stats.loads_past_deadline += late
        for load in t.loads:
            tier = load.tier() if load.done else None
            if tier is None or epoch != t.epoch:
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
        """Releases the pages of abandoned loads that have stopped; call between steps."""
        for load in self._transfers.reap():
            self._pool.release(load.block_ids, load.high)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a ticket has something to collect (its lookup answered, its loads all landed), at most
        until the nearest deadline or `timeout_s`. Tickets waiting for pages have nothing to collect: with
        nothing running, no pages free up, and the engine sleeps between looks rather than spinning."""
        deadlines = [t.deadline for t in self._tickets.values() if t.deadline is not None]
        if deadlines:
            timeout_s = max(0.0, min(timeout_s, min(deadlines) - self._clock()))
        tickets = list(self._tickets.values())
        self._transfers.wait(timeout_s, lambda: any(_collectable(t) for t in tickets))

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
            self._pool.index.hits[indexed] = max(1, self._pool.index.hits.get(indexed, 0))  # asked for again: reused
            blocks.append(indexed)
            hashes.append(span.block_hashes[i])
        return True

    def _let_go(self, seq_id: str, t: LoadTicket) -> None:
        self._tiers.drop_read_ahead([*t.unstarted, *(load.found for load in t.loads if not load.done)])
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


def _found(lookup: Future) -> list[FoundChunk]:
    """A finished lookup's chunks; none when it failed (its tokens are computed)."""
    try:
        return lookup.result(timeout=0)
    except CancelledError:
        return []
    except Exception:  # the worker would swallow it; a failed lookup only costs a recompute
        log.exception("looking up KV chunks below the device failed")
        return []


def _collectable(t: LoadTicket) -> bool:
    """Whether `ready` would have news for it now: its lookup answered, a load ended with more to submit, or
    every load it needs landed."""
    if t.lookup is not None:
        return t.lookup.done()
    if t.unstarted:
        return bool(t.loads) and sum(not load.done for load in t.loads) < LOADS_AHEAD
    return all(load.done for load in t.loads)
