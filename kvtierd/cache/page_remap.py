"""Compaction's renaming of pages: one value every holder of a page id applies to itself.

Page b becomes page `new_id[b]`, a permutation of every id, so each order a
holder keeps (the free queue, the eviction order) stays as it was. Each
holder of page ids (the block pool's parts, page tables, session pools,
pins) has a `remap(remap)` method; the cache manager hands them all the same
`PageRemap` once the KV was copied the same way (`cache/compaction.py`).

Generations: a renamed page's generation steps past the old generations of
both its ids, so every weak (page, generation) reference to either id goes
stale; `weak` renames those that were current, and a stale one stays stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class PageRemap:
    new_id: Sequence[int]  # page b becomes page new_id[b]: a permutation of every page id
    free: Sequence[int]  # the pages that hold nothing afterwards (new ids, ascending): reused first
    old_generation: Sequence[int]  # each page's generation before
    new_generation: Sequence[int]  # each page's generation after (by its new id)

    @classmethod
    def of(cls, new_id: Sequence[int], free: Sequence[int], generation: Sequence[int]) -> PageRemap:
        after = [0] * len(generation)
        for b, new in enumerate(new_id):
            after[new] = generation[b] if new == b else max(generation[b], generation[new]) + 1
        return cls(list(new_id), list(free), list(generation), after)

    def __getitem__(self, block_id: int) -> int:
        return self.new_id[block_id]

    def ids(self, block_ids: Iterable[int]) -> list[int]:
        return [self.new_id[b] for b in block_ids]

    def keys(self, by_page: Mapping[int, V]) -> dict[int, V]:
        """A map keyed by page, with its keys renamed."""
        return {self.new_id[b]: v for b, v in by_page.items()}

    def values(self, to_page: Mapping[K, int]) -> dict[K, int]:
        """A map to pages, with its values renamed."""
        return {k: self.new_id[b] for k, b in to_page.items()}

    def order(self, pages: Iterable[int]) -> OrderedDict[int, None]:
        """An ordered set of pages renamed, in the same order."""
        return OrderedDict.fromkeys(self.new_id[b] for b in pages)

    def per_page(self, values: Sequence[V]) -> list[V]:
        """A list indexed by page id, moved to the new ids."""
        out = list(values)
        for b, value in enumerate(values):
            out[self.new_id[b]] = value
        return out

    def weak(self, block_id: int, generation: int) -> tuple[int, int] | None:
        """A weak reference renamed: the page's new id and generation while it was current, else None."""
        if generation != self.old_generation[block_id]:
            return None
        new = self.new_id[block_id]
        return new, self.new_generation[new]
