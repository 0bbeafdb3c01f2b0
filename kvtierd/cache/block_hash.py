"""Chained block hashes: the identity of a full page of tokens in a namespace.

    h_0 = H(fingerprint || tenant salt)          the namespace root
    h_i = H(h_{i-1} || token ids of block i)     over full blocks only

A hash names a page's whole prefix, so equal hashes mean equal KV (the stored
tokens are still compared on a hit, so a collision can never serve wrong KV).
A different model fingerprint or tenant gives a different root, and with it
different hashes for the same tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)

# md5 is the default; sha256 for those who want no known collisions; xxh3-128 is
# the fastest (not cryptographic: the token check on every hit is what makes
# any of them safe).
HASH_FUNCTIONS = ("md5", "sha256", "xxh3-128")


def _digest(algorithm: str, *parts: bytes) -> BlockHash:
    if algorithm not in HASH_FUNCTIONS:
        raise ValueError(f"hash function must be one of {', '.join(HASH_FUNCTIONS)}, not {algorithm!r}")
    h = xxhash.xxh3_128() if algorithm == "xxh3-128" else hashlib.new(algorithm)
    for part in parts:
        h.update(part)
    return BlockHash(h.digest())


def namespace_root(fingerprint: str, tenant_salt: str, algorithm: str = "md5") -> BlockHash:
    # The algorithm is part of the root, so pages hashed one way never match another's.
    return _digest(algorithm, algorithm.encode(), b"\0", fingerprint.encode(), b"\0", tenant_salt.encode())


def hash_block(parent: BlockHash, tokens: Sequence[int], algorithm: str = "md5") -> BlockHash:
    return _digest(algorithm, parent, array("i", tokens).tobytes())


def hash_full_blocks(
    parent: BlockHash, token_ids: Sequence[int], block_size: int, start_block: int = 0, algorithm: str = "md5"
) -> list[BlockHash]:
    """Hashes of the full blocks from `start_block` on, chained from `parent`."""
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], algorithm)
        out.append(parent)
    return out


@dataclass(slots=True)
class BlockHashes:
    """One sequence's chained page hashes in its namespace, each computed once: a request's tokens only
    grow (prompt, then output), so the hashes of its first pages never change. Made when its prompt is
    known and carried with it, so its lookups, loads and commits share them."""

    root: BlockHash
    block_size: int
    algorithm: str = "md5"
    hashes: list[BlockHash] = field(default_factory=list)

    def first(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The hashes of the first `num_blocks` full pages of `token_ids` (this sequence's tokens)."""
        bs = self.block_size
        assert num_blocks * bs <= len(token_ids), "hashing a page that is not full"
        for i in range(len(self.hashes), num_blocks):
            parent = self.hashes[-1] if self.hashes else self.root
            self.hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs], self.algorithm))
        return self.hashes[:num_blocks]

    def of_full_pages(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of every full page of `token_ids`."""
        return self.first(token_ids, len(token_ids) // self.block_size)


def rebase(public_hash: BlockHash, tenant_root: BlockHash, algorithm: str = "md5") -> BlockHash:
    """Where a tenant's own pages chain from after a public prefix's last page.

    Pages after a public prefix hold the tenant's tokens, so they chain under
    the tenant's root as well: another tenant with the same continuation gets
    another hash, and only the public part is shared."""
    return _digest(algorithm, public_hash, b"\0rebase\0", tenant_root)
