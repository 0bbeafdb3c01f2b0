"""Fragmentation of the device page pool: how far its free space and its sequences are from long runs.

Two ratios, defined here once; compaction (`cache/compaction.py`), `/admin/compact`
and the metrics all read them:

    page     0 1 2 3 4 5 6 7 8 9
    holds    A A . B . . A B . .     A: a sequence on pages 0, 1, 6; B: one on 3, 7

- **free space** = 1 - (longest run of free page ids / free pages), 0 when
  there is no free page. A free page holds nothing anyone may read: nobody
  holds, pins or indexes it, and no session pool keeps it. Above: runs [2],
  [4 5], [8 9], so 1 - 2/5 = 0.6. Idle cached pages are not free here: they
  hold KV worth keeping (allocation may still evict them).
- **sequence** = the share of chained pages whose next page does not have
  the next id. A chained page has a next page in some sequence: a running
  sequence's page table, a session pool's resident head, or the prefix
  index (the pages chained after it). A page whose chain branches has
  several next pages, of which only one can follow it: it counts as in
  order when one does. Above: 0 -> 1 in order, 1 -> 6 and 3 -> 7 not: 0.67.

Why these: a new sequence gets consecutive pages only from a long free run,
and KV leaves the device in chunks of consecutive pages of one chain
(`tiers/chunk.py`), gathered by page id. A chunk whose ids run consecutively
is one contiguous range of the device tensors: one large copy instead of
page-sized pieces.

Not to be confused with `kvtierd_page_fragmentation_ratio`, the unused token
slots in running sequences' last pages (internal fragmentation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.pins import Pins
from kvtierd.cache.session_pool import SessionPools


@dataclass(slots=True)
class PageUse:
    """Who needs which device pages: what the measure and the compaction plan read."""

    num_blocks: int
    live: set[int]  # pages holding KV someone may read; every other page is free
    fixed: set[int]  # live pages held by something that cannot be renamed: they keep their ids
    sequences: list[list[int]]  # pages in order: running sequences' page tables, then session pools' heads
    index_links: list[tuple[int, int]]  # (page, an indexed page chained after it)


@dataclass(frozen=True, slots=True)
class Fragmentation:
    free_pages: int
    free_runs: int  # maximal runs of consecutive free page ids
    longest_free_run: int
    chained_pages: int  # pages with a next page in some sequence
    scattered_pages: int  # of those, pages none of whose next pages has the next id

    @property
    def free_space(self) -> float:
        return 1.0 - self.longest_free_run / self.free_pages if self.free_pages else 0.0

    @property
    def sequence(self) -> float:
        return self.scattered_pages / self.chained_pages if self.chained_pages else 0.0


def measure(use: PageUse) -> Fragmentation:
    free = runs = longest = run = 0
    for b in range(use.num_blocks):
        if b in use.live:
            run = 0
            continue
        free += 1
        run += 1
        runs += run == 1
        longest = max(longest, run)
    links = {(a, b) for seq in use.sequences for a, b in zip(seq, seq[1:])} | set(use.index_links)
    chained = {a for a, _ in links}
    return Fragmentation(free, runs, longest, len(chained), sum((a, a + 1) not in links for a in chained))


def page_use(pool: BlockPool, tables: Iterable[PageTable], sessions: SessionPools, pins: Pins) -> PageUse:
    """Which pages hold KV someone may read, and the sequences and chains they form."""
    tables = list(tables)
    held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
    live = set(held)
    sequences = [list(table.block_ids) for table in tables]
    for _, chain in sessions:
        resident = [pool.generation[b] == gen for b, gen in zip(chain.block_ids, chain.generations)]
        live.update(b for b, ok in zip(chain.block_ids, resident) if ok)
        head = resident.index(False) if False in resident else len(resident)  # what a hit may use
        sequences.append(chain.block_ids[:head])
    indexed = pool.cached_blocks()
    live.update(b for b, _ in indexed)
    live.update(b for pin in pins for b in pin.block_ids)
    # An indexed page's parent is indexed too.
    links = [(pool.block_of(page.parent_hash), b) for b, page in indexed if page.parent_hash is not None]
    # A reference from outside every page table (a load in flight) could not be renamed: its page stays.
    table_refs = Counter(b for table in tables for b in table.block_ids)
    fixed = {b for b in held if pool.ref_count(b) != table_refs[b]}
    return PageUse(pool.num_blocks, live, fixed, sequences, links)
