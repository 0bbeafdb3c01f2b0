"""Chunks of evicted pages: what a capacity eviction hands the lower tiers to save.

With lower tiers (`chunk_pages` > 0), a capacity eviction takes the evicted
page's whole chunk (the pages from the last multiple of `chunk_pages` in its
chain up to it; `tiers/chunk.py`): the block pool logs it, and its other idle
pages go too, so a chain is saved below once per chunk rather than once per
page as its tail shrinks. The pages keep their KV until someone writes into
them: the cache manager saves the log below before that.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.prefix_index import PrefixIndex


@dataclass(slots=True, frozen=True)
class EvictedChunk:
    """Pages evicted for capacity, as the chunk the lower tiers store; their KV is intact until rewritten."""

    root: BlockHash
    first_depth: int  # a multiple of chunk_pages
    block_ids: tuple[int, ...]  # some may still be indexed (held by others, or shared by another chain)
    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]
    hits: int  # the most any of its pages was hit


def chunk_ending_at(index: PrefixIndex, block_id: int, chunk_pages: int) -> EvictedChunk | None:
    """The chunk whose last page is `block_id`; None if it spans two namespaces (a public prefix and a
    tenant's pages after it: not stored below in this version)."""
    page = index.pages[block_id]
    pages = [(block_id, page)]
    while page.depth % chunk_pages:
        b = index.by_hash[page.parent_hash]  # an indexed page's parent is indexed
        page = index.pages[b]
        pages.append((b, page))
    pages.reverse()
    if any(p.root != page.root for _, p in pages):
        return None
    return EvictedChunk(page.root, page.depth, tuple(b for b, _ in pages), tuple(p.block_hash for _, p in pages),
                        tuple(t for _, p in pages for t in p.tokens), max(index.hits.get(b, 0) for b, _ in pages))


def chunks_next_in_line(index: PrefixIndex, idle: Collection[int], chunk_pages: int,
                        max_pages: int) -> list[EvictedChunk]:
    """The chunks that capacity evictions would log next, up to `max_pages` pages: those ending at `idle`
    chain tails, in `idle`'s order (least recently released first: the order of `lru`)."""
    chunks: list[EvictedChunk] = []
    pages = 0
    if not chunk_pages:
        return chunks
    for tail in list(idle):
        if pages >= max_pages:
            break
        b: int | None = tail if index.is_leaf(tail) else None
        while b is not None and pages < max_pages and (chunk := chunk_ending_at(index, b, chunk_pages)) is not None:
            chunks.append(chunk)
            pages += len(chunk.block_ids)
            # Then the chunk before it, once this one is gone: an idle page with no other child.
            parent = index.pages[chunk.block_ids[0]].parent_hash
            b = index.by_hash.get(parent) if parent is not None else None
            if b is None or b not in idle or len(index.children.get(parent, ())) > 1:
                b = None
    return chunks
