"""Fixed-size KV pages with reference counts, a free queue and a prefix index.

A page whose reference count drops to zero keeps its contents and its hash: it
is free to be reused, but until it is, a request with the same prefix can take
it back (`touch`). The free queue is in eviction order, least recently released
first; allocation takes pages from its head and forgets their hashes then.

Running out of pages is a normal outcome (`allocate` returns None and the
caller waits or preempts); a broken count is a bug and asserts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from kvtierd.cache.block_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one page; raise the KV budget")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix index: hash -> page, and what each cached page holds.
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._root_of: dict[int, BlockHash] = {}  # the namespace a cached page belongs to
        self.hits: dict[int, int] = {}
        self.last_access: dict[int, float] = {}
        self.num_token_mismatches = 0

    @property
    def num_free_blocks(self) -> int:
        """Pages allocation may take: never used, or cached with no reference."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Takes `n` free pages with ref count 1, or None if there are fewer free."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            assert self._ref_counts[b] == 0, f"free page {b} still referenced"
            self._forget(b)
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"sharing unowned page {b}"
            self._ref_counts[b] += 1

    def touch(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on cached pages, taking them off the free queue if idle."""
        now = time.monotonic()
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
            self.hits[b] = self.hits.get(b, 0) + 1
            self.last_access[b] = now

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each page; pages reaching zero become free.

        Give a sequence's pages in order: they are queued tail first, so the
        end of a chain is evicted before its shared beginning."""
        now = time.monotonic()
        for b in reversed(block_ids):
            assert self._ref_counts[b] > 0, f"releasing unowned page {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                self.last_access[b] = now

    def cache(self, block_id: int, block_hash: BlockHash, tokens: Sequence[int], root: BlockHash) -> None:
        """Indexes a full page under its hash (the first page with a hash keeps it)."""
        if block_hash in self._by_hash or block_id in self._hash_of:
            return
        self._by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tuple(tokens)
        self._root_of[block_id] = root
        self.last_access[block_id] = time.monotonic()

    def lookup(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]]) -> list[int]:
        """Pages of the longest cached prefix of `hashes`, each confirmed by its tokens."""
        found = []
        for h, tokens in zip(hashes, token_chunks):
            b = self._by_hash.get(h)
            if b is None:
                break
            if self._tokens_of[b] != tuple(tokens):
                self.num_token_mismatches += 1  # a collision or a planted value: never served
                break
            found.append(b)
        return found

    def evict(self, block_id: int) -> bool:
        """Forgets an idle cached page now and puts it first in line for reuse."""
        if self._ref_counts[block_id] != 0 or block_id not in self._hash_of:
            return False
        self._forget(block_id)
        self._free.move_to_end(block_id, last=False)
        return True

    def cached_blocks(self) -> list[tuple[int, BlockHash, BlockHash, tuple[int, ...]]]:
        """(page, hash, namespace root, tokens) of every indexed page."""
        return [(b, h, self._root_of[b], self._tokens_of[b]) for b, h in self._hash_of.items()]

    def _forget(self, block_id: int) -> None:
        h = self._hash_of.pop(block_id, None)
        if h is not None:
            del self._by_hash[h]
            del self._tokens_of[block_id]
            del self._root_of[block_id]
        self.hits.pop(block_id, None)
        self.last_access.pop(block_id, None)
