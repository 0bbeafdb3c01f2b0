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
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

HASH_FUNCTIONS = ("md5", "sha256")


def namespace_root(fingerprint: str, tenant_salt: str, algorithm: str = "md5") -> BlockHash:
    h = hashlib.new(algorithm)
    h.update(fingerprint.encode())
    h.update(b"\0")
    h.update(tenant_salt.encode())
    return BlockHash(h.digest())


def hash_block(parent: BlockHash, tokens: Sequence[int], algorithm: str = "md5") -> BlockHash:
    h = hashlib.new(algorithm, parent)
    h.update(array("i", tokens).tobytes())
    return BlockHash(h.digest())


def hash_full_blocks(
    parent: BlockHash, token_ids: Sequence[int], block_size: int, start_block: int = 0, algorithm: str = "md5"
) -> list[BlockHash]:
    """Hashes of the full blocks from `start_block` on, chained from `parent`."""
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], algorithm)
        out.append(parent)
    return out
