"""One sequence's page table: which pages hold its tokens, in order."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.page_remap import PageRemap


@dataclass(slots=True)
class PageTable:
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens with a slot assigned (written or about to be)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the leading full, computed pages
    public_blocks: int = 0  # leading pages adopted from the public namespace
    own_from: int = 0  # its first page not adopted from the prefix index
    high: bool = False  # a high-class sequence: may use the reserved region, and its pages count against it

    def num_new_blocks(self, num_new_tokens: int) -> int:
        """Pages to add so `num_new_tokens` more tokens fit."""
        needed = -(-(self.num_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(self.block_ids))

    def slots(self, start: int, count: int) -> list[int]:
        """Cache slots (page * block_size + offset) of tokens start .. start+count-1."""
        bs, ids = self.block_size, self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, start + count)]

    @property
    def last_block_is_partial(self) -> bool:
        return self.num_tokens % self.block_size != 0

    def remap(self, remap: PageRemap) -> None:
        self.block_ids = remap.ids(self.block_ids)
