"""Chunks: runs of up to N consecutive full pages of one chain, the unit the lower tiers store.

Key scheme. Chunks are aligned to their chain: chunk j holds pages
[j*N, (j+1)*N) counted from the chain's first page, and is keyed by the
chained hash of its last page (which names the whole prefix, namespace
included). A chain whose length is not a multiple of N ends with a partial
chunk [j*N, end), keyed by the hash of page end-1:

    pages   0 ........ 15 | 16 ........ 31 | 32 .. 36
    chunk   key h_15      | key h_31        | key h_36   (N = 16; the last one partial)

So a prompt's longest stored prefix takes few probes: one batched call per
tier over the keys of whole chunks (h_{N-1}, h_{2N-1}, ...), then, in the
first region with no whole chunk, the partial keys from the longest down.
A partial chunk of a chain that later grew stays until the LRU takes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import ChunkIdentity
from kvtierd.tiers.tier import Tier


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    namespace: bytes  # the chain's namespace root (model fingerprint + tenant)
    first_page: int  # position in its chain of its first page: a multiple of N
    block_hashes: tuple[bytes, ...]  # chained hash of each page; the last one keys the chunk
    token_ids: tuple[int, ...]  # block_size ids per page, page after page

    @property
    def num_pages(self) -> int:
        return len(self.block_hashes)

    @property
    def last_hash(self) -> bytes:
        return self.block_hashes[-1]

    def page_tokens(self, i: int) -> tuple[int, ...]:
        bs = len(self.token_ids) // self.num_pages
        return self.token_ids[i * bs : (i + 1) * bs]

    def identity(self, geometry: KVGeometry) -> ChunkIdentity:
        return ChunkIdentity(geometry, self.namespace, self.block_hashes, self.token_ids)


@dataclass(frozen=True, slots=True)
class FoundChunk:
    tier: Tier  # where the lookup found it
    span: ChunkSpan


@dataclass(frozen=True, slots=True)
class ChunkCopy:
    """A chunk whose KV sits in device pages now, to be saved below."""

    span: ChunkSpan
    block_ids: tuple[int, ...]  # the device pages holding it, in order
    hits: int = 0  # the most any of its pages was hit: what disk admission looks at


def spans_of(namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
             chunk_pages: int, first: int = 0) -> list[ChunkSpan]:
    """The aligned chunks covering pages [first, len(block_hashes)) of a chain (`first` a multiple of N).

    `token_ids` are the chain's tokens from its start (at least its full pages)."""
    assert first % chunk_pages == 0, "chunks start at multiples of chunk_pages"
    spans = []
    for start in range(first, len(block_hashes), chunk_pages):
        end = min(start + chunk_pages, len(block_hashes))
        spans.append(ChunkSpan(namespace, start, tuple(block_hashes[start:end]),
                               tuple(token_ids[start * block_size : end * block_size])))
    return spans
