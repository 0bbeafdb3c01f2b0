"""Allocates pages to sequences: the one place that edits page tables.

    page table of a sequence with block_size 4 and 6 tokens:

        page 7: [t0 t1 t2 t3]   full
        page 2: [t4 t5 .  .]    partial: the next 2 tokens land here

Pages are shared between sequences by reference count: through the prefix
index (`find_prefix` + `adopt_prefix`: full pages whose chained hash and tokens
match) or by `fork`. A shared page is read-only: before a sequence writes into
a shared partial page, it gets a private copy (copy-on-write); the copy is
returned in `Allocation.copies` and the caller performs it on the device before
the step writes. Full pages are indexed as soon as their tokens are computed
(`commit`), so requests running at the same time already share them. Which
idle cached page goes first when pages run out is the pool's eviction policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash, hash_full_blocks
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.page_table import PageTable


@dataclass(slots=True)
class Allocation:
    slots: list[int]  # one cache slot per new token, in order
    copies: list[tuple[int, int]]  # (src page, dst page) to copy before writing


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: str = "lru",
        prefix_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        hash_algorithm: str = "md5",
    ) -> None:
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.pool = BlockPool(num_blocks, eviction_policy, prefix_ttl_s, clock)
        self._tables: dict[str, PageTable] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def table(self, seq_id: str) -> PageTable:
        return self._tables[seq_id]

    def block_ids(self, seq_id: str) -> list[int]:
        return self._tables[seq_id].block_ids

    def allocate_slots(self, seq_id: str, num_new_tokens: int) -> Allocation | None:
        """Assigns slots to the next tokens of `seq_id`, or None when pages run out (nothing changes then)."""
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = PageTable(self.block_size)
        cow = table.last_block_is_partial and self.pool.ref_count(table.block_ids[-1]) > 1
        num_new = table.num_new_blocks(num_new_tokens) + (1 if cow and num_new_tokens else 0)
        fresh = self.pool.allocate(num_new)
        if fresh is None:
            if not table.block_ids:
                del self._tables[seq_id]
            return None
        copies = []
        if cow and num_new_tokens:
            shared = table.block_ids[-1]
            private = fresh.pop(0)
            copies.append((shared, private))
            table.block_ids[-1] = private
            self.pool.release([shared])
        table.block_ids.extend(fresh)
        slots = table.slots(table.num_tokens, num_new_tokens)
        table.num_tokens += num_new_tokens
        return Allocation(slots=slots, copies=copies)

    def find_prefix(self, root: BlockHash, token_ids: Sequence[int]) -> PrefixHit:
        """The longest run of cached full pages that starts `token_ids`, leaving at
        least one token to compute (its logits give the next token)."""
        bs = self.block_size
        usable = (len(token_ids) - 1) // bs
        hashes = hash_full_blocks(root, token_ids[: usable * bs], bs, algorithm=self.hash_algorithm)
        chunks = [token_ids[i * bs : (i + 1) * bs] for i in range(usable)]
        blocks = self.pool.lookup(hashes, chunks)
        return PrefixHit(blocks, hashes[: len(blocks)], len(blocks) * bs)

    def adopt_prefix(self, seq_id: str, hit: PrefixHit) -> None:
        """Starts `seq_id`'s page table with the hit's pages (shared, read-only)."""
        assert seq_id not in self._tables, f"sequence {seq_id} already has pages"
        self.pool.touch(hit.block_ids)
        self._tables[seq_id] = PageTable(self.block_size, list(hit.block_ids), hit.num_tokens, list(hit.block_hashes))

    def commit(self, seq_id: str, root: BlockHash, token_ids: Sequence[int], num_computed: int) -> None:
        """Indexes the pages of `seq_id` that the first `num_computed` tokens fill."""
        table = self._tables[seq_id]
        done = len(table.block_hashes)
        parent = table.block_hashes[-1] if done else root
        new = hash_full_blocks(parent, token_ids[: num_computed - num_computed % self.block_size], self.block_size, done,
                               self.hash_algorithm)
        bs = self.block_size
        for i, h in enumerate(new, start=done):
            self.pool.cache(table.block_ids[i], h, token_ids[i * bs : (i + 1) * bs], root, depth=i, parent=parent)
            parent = h
        table.block_hashes.extend(new)

    def evict_prefix(self, root: BlockHash, token_ids: Sequence[int]) -> int:
        """Evicts the idle cached pages of `token_ids`' chain; returns how many."""
        bs = self.block_size
        n = len(token_ids) // bs
        hashes = hash_full_blocks(root, token_ids[: n * bs], bs, algorithm=self.hash_algorithm)
        blocks = self.pool.lookup(hashes, [token_ids[i * bs : (i + 1) * bs] for i in range(n)])
        return sum(self.pool.evict(b) for b in blocks)

    def invalidate_namespace(self, root: BlockHash) -> int:
        """Drops every cached page of a namespace (a tenant's cache flushed); returns how many.

        Sequences holding some keep reading them; those pages are freed uncached."""
        return self.pool.invalidate_namespace(root)

    def expire(self, now: float | None = None) -> int:
        """Evicts a bounded number of idle cached pages past the prefix TTL; call between steps."""
        return self.pool.expire(now)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes `child_id` share every page of `parent_id` (e.g. for n > 1 samples)."""
        parent = self._tables[parent_id]
        assert child_id not in self._tables, f"sequence {child_id} already has pages"
        self.pool.share(parent.block_ids)
        self._tables[child_id] = PageTable(
            self.block_size, list(parent.block_ids), parent.num_tokens, list(parent.block_hashes)
        )

    def free(self, seq_id: str) -> None:
        """Returns a sequence's pages; a no-op for a sequence that holds none."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self.pool.release(table.block_ids)
