"""The sequences' page tables, and the one place that edits them: slots for new tokens (a private copy of a
shared page before writing into it), tables started from a cached prefix or forked from another, and the pages
a sequence's computed tokens fill indexed under their hashes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash, BlockHashes, rebase
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.page_table import PageTable
from kvtierd.cache.prefix_lookup import PrefixHit


@dataclass(slots=True)
class Allocation:
    slots: list[int]  # one cache slot per new token, in order
    copies: list[tuple[int, int]]  # (src page, dst page) to copy before writing


class PageTables:
    def __init__(self, pool: BlockPool, block_size: int, hash_algorithm: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self._tables: dict[str, PageTable] = {}

    def __getitem__(self, seq_id: str) -> PageTable:
        return self._tables[seq_id]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def get(self, seq_id: str) -> PageTable | None:
        return self._tables.get(seq_id)

    def values(self) -> Iterable[PageTable]:
        return self._tables.values()

    def pop(self, seq_id: str) -> PageTable | None:
        return self._tables.pop(seq_id, None)

    def allocate(self, seq_id: str, num_new_tokens: int, high: bool = False) -> Allocation | None:
        """Assigns slots to the next tokens of `seq_id`, or None when pages run out (nothing changes then).
        `high` applies to a sequence's first allocation (its class stays with its page table)."""
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = PageTable(self.block_size, high=high)
        last = table.block_ids[-1] if table.last_block_is_partial else None
        cow = last is not None and num_new_tokens > 0 and (
            self.pool.ref_count(last) > 1 or self.pool.page_info(last) is not None)
        fresh = self.pool.allocate(table.num_new_blocks(num_new_tokens) + cow, table.high)
        if fresh is None:
            if not table.block_ids:
                del self._tables[seq_id]
            return None
        copies = []
        if cow:
            private = fresh.pop(0)
            copies.append((last, private))
            table.block_ids[-1] = private
            self.pool.release([last], table.high)
        elif last is not None and num_new_tokens:
            self.pool.note_write(last)
        table.block_ids.extend(fresh)
        slots = table.slots(table.num_tokens, num_new_tokens)
        table.num_tokens += num_new_tokens
        return Allocation(slots=slots, copies=copies)

    def allocated(self, seq_id: str, start: int, num_tokens: int) -> Allocation:
        """The slots `allocate` gave tokens `start` .. of `seq_id` already, for a step that computes them
        again in part (a split join's second part: engine/scheduler.py): nothing new, nothing to copy."""
        table = self._tables[seq_id]
        assert start + num_tokens <= table.num_tokens, "those tokens have no slots yet"
        return Allocation(slots=table.slots(start, num_tokens), copies=[])

    def adopt(self, seq_id: str, hit: PrefixHit, high: bool) -> None:
        """Starts `seq_id`'s table with the hit's pages (the caller took its references)."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has pages"
        self._tables[seq_id] = PageTable(self.block_size, list(hit.block_ids), hit.num_tokens,
                                         list(hit.block_hashes), hit.public_blocks, hit.own_from, high)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes `child_id` share every page of `parent_id` (e.g. for n > 1 samples)."""
        parent = self._tables[parent_id]
        assert child_id not in self._tables, f"sequence {child_id} already has pages"
        self.pool.share(parent.block_ids, parent.high)
        self._tables[child_id] = PageTable(
            self.block_size, list(parent.block_ids), parent.num_tokens, list(parent.block_hashes), parent.public_blocks,
            parent.own_from, parent.high
        )

    def index(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], num_computed: int,
              tag: str | None = None, hashes: BlockHashes | None = None) -> None:
        """Indexes the pages of `seq_id` that the first `num_computed` tokens fill (`hashes`: the request's
        own, when it has them)."""
        table = self._tables[seq_id]
        done, bs = len(table.block_hashes), self.block_size
        if num_computed // bs <= done:
            return
        prev = table.block_hashes[-1] if done else None
        if hashes is not None and not table.public_blocks:
            assert hashes.root == root, "a request's hashes belong to its namespace"
            new = hashes.first(token_ids, num_computed // bs)[done:]
        else:  # chained from its last indexed page; a tenant's first own page after a public prefix: rebased
            chain = root if prev is None else prev
            if prev is not None and done == table.public_blocks:
                chain = rebase(prev, root, self.hash_algorithm)
            new = BlockHashes(chain, bs, self.hash_algorithm).of_full_pages(token_ids[done * bs : num_computed])
        for i, h in enumerate(new, start=done):
            self.pool.cache(table.block_ids[i], h, token_ids[i * bs : (i + 1) * bs], root, depth=i, parent=prev)
            prev = h
        if tag is not None:
            self.pool.tag(table.block_ids[done : done + len(new)], tag)
        table.block_hashes.extend(new)
