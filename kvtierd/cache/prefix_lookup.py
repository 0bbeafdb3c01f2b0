"""Finding a prompt's cached start: its session's pool, the tenant's prefix index, or the public one.

The longest wins, leaving at least one token to compute (its logits give the
next token): the session's pool to the token, the indexes by whole pages. A
prompt whose every page is indexed (its length a whole number of pages) hits
all but its last token: its last page is adopted partly used and copied before
that token is written (`KVCacheManager.allocate_slots`), so the step it joins
computes one token, not a page (16 queries over a long context cost a
decoding batch's step several times over).
The tenant's index hit may go on with the chunks the lower tiers hold past
it (`below`). A tenant's pages after a public prefix chain from the public
page's hash rebased onto the tenant's root (`block_hash.rebase`), so only the
public part is ever shared.

A request's page hashes in its own namespace come from its `BlockHashes`,
computed once as its tokens become known (`cache/block_hash.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvtierd.cache.block_hash import BlockHash, BlockHashes, rebase
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.session_pool import SessionKey, SessionPools
from kvtierd.tiers.chunk import FoundChunk
from kvtierd.tiers.restore_planner import NOTHING_BELOW, RestorePlan
from kvtierd.tiers.tier_manager import TierManager


@dataclass(slots=True)
class PrefixHit:
    block_ids: list[int]  # the last one may be partly used (a session hit)
    block_hashes: list[BlockHash]  # of the leading full pages
    num_tokens: int
    source: str = "none"  # "session", "prefix" (the tenant's index) or "public"
    public_blocks: int = 0  # leading pages from the public namespace
    own_from: int = 0  # for a session: its first page not adopted from the prefix index
    below: list[FoundChunk] = field(default_factory=list)  # planned: chunks to load after block_ids (in num_tokens)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # adopted: tokens loaded from "host" / "disk"
    restore: RestorePlan = NOTHING_BELOW  # adopted: whether `below` was loaded or left to recompute


NO_HIT = PrefixHit([], [], 0)


def on_device(hit: PrefixHit, block_size: int) -> PrefixHit:
    """A hit without the chunks found below: its device pages only."""
    if not hit.below:
        return hit
    n = len(hit.block_ids)
    return replace(hit, num_tokens=min(n * block_size, hit.num_tokens), source=hit.source if n else "none",
                   below=[])


@dataclass(frozen=True, slots=True)
class DeviceHit:
    """A prompt's pages in its tenant's index, and the hashes of every full page of it."""

    block_ids: list[int]
    hashes: list[BlockHash]  # of the prompt's full pages
    token_ids: Sequence[int]  # the prompt

    @property
    def complete(self) -> bool:
        return len(self.block_ids) == len(self.hashes)


class PrefixLookup:
    def __init__(self, pool: BlockPool, sessions: SessionPools, block_size: int, hash_algorithm: str,
                 public_root: BlockHash | None, tiers: TierManager | None) -> None:
        self.pool = pool
        self.sessions = sessions
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.public_root = public_root  # the namespace every tenant may hit; None: no public prefixes
        self.tiers = tiers

    def hashes(self, root: BlockHash) -> BlockHashes:
        """A new sequence's hashes in namespace `root`."""
        return BlockHashes(root, self.block_size, self.hash_algorithm)

    def pages(self, hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[int]:
        """The indexed pages of the longest cached start of these full pages, each confirmed by its tokens."""
        bs = self.block_size
        return self.pool.lookup(hashes, [token_ids[i * bs : (i + 1) * bs] for i in range(len(hashes))])

    def device_hit(self, hashes: BlockHashes, token_ids: Sequence[int]) -> DeviceHit:
        """`token_ids`' pages in its tenant's index."""
        full = hashes.of_full_pages(token_ids)
        return DeviceHit(self.pages(full, token_ids), full, token_ids)

    def find(self, hashes: BlockHashes, token_ids: Sequence[int], session_id: str | None = None,
             below: bool = True, device: DeviceHit | None = None) -> PrefixHit:
        """The longest cached start of `token_ids`: from the session's pool (to the token), the tenant's
        prefix index or the public one (whole pages). `below`: the tenant's index hit is extended by the
        chunks the lower tiers hold. `device`: the tenant's index hit, when the caller looked already."""
        root = hashes.root
        best = self._index_hit(hashes, device or self.device_hit(hashes, token_ids), below)
        if self.public_root is not None and root != self.public_root and self.pool.has_namespace(self.public_root):
            public = self._public_hit(root, token_ids)
            if public.num_tokens > best.num_tokens:
                best = public
        if session_id is not None:
            session = self._session_hit((root, session_id), token_ids)
            if session.num_tokens > best.num_tokens:
                best = session
        return best

    def _index_hit(self, hashes: BlockHashes, hit: DeviceHit, below: bool) -> PrefixHit:
        blocks = hit.block_ids
        found = self.tiers.lookup(hashes.root, hit.hashes, hit.token_ids, len(blocks)) \
            if self.tiers is not None and below else []
        end = found[-1].span.first_page + found[-1].span.num_pages if found else len(blocks)
        n = min(end * self.block_size, len(hit.token_ids) - 1)  # its last token stays to compute
        return PrefixHit(blocks, hit.hashes[: min(len(blocks), n // self.block_size)], n, "prefix" if n else "none",
                         own_from=len(blocks), below=found)

    def _public_hit(self, root: BlockHash, token_ids: Sequence[int]) -> PrefixHit:
        usable = token_ids[: len(token_ids) - 1]
        public = self.hashes(self.public_root).of_full_pages(usable)
        blocks = self.pages(public, usable)
        if not blocks:
            return NO_HIT
        k, bs = len(blocks), self.block_size
        own = BlockHashes(rebase(public[k - 1], root, self.hash_algorithm), bs, self.hash_algorithm)
        rest = usable[k * bs :]
        more_hashes = own.of_full_pages(rest)
        more = self.pages(more_hashes, rest)
        n = k + len(more)
        return PrefixHit(blocks + more, public[:k] + more_hashes[: len(more)], n * bs, "public", k, n)

    def _session_hit(self, key: SessionKey, token_ids: Sequence[int]) -> PrefixHit:
        chain = self.sessions.get(key)
        if chain is None:
            return NO_HIT
        n = 0
        limit = min(len(chain.token_ids), len(token_ids) - 1)
        while n < limit and chain.token_ids[n] == token_ids[n]:
            n += 1
        bs = self.block_size
        for i in range(-(-n // bs)):  # each page must still hold what the chain kept
            if self.pool.generation[chain.block_ids[i]] != chain.generations[i]:
                n = i * bs
                break
        if n == 0:
            return NO_HIT
        full = n // bs
        return PrefixHit(chain.block_ids[: -(-n // bs)], chain.block_hashes[:full], n, "session",
                         min(chain.public_blocks, full), min(chain.own_from, full))
