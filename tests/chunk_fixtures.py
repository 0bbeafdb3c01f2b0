"""Chunk factories for the storage tests, and the writer a crash test kills.

Chunks are made from (batch, index) alone, so a process that did not write
them (the test, after kill -9) knows what each key's value must be.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import torch

from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import ChunkIdentity, encode_frame

TINY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float16)
NAMESPACE = b"fingerprint|tenant"


def make_identity(pages: int = 2, *, geometry: KVGeometry = TINY, namespace: bytes = NAMESPACE,
                  seed: int = 0) -> ChunkIdentity:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 50_000, pages * geometry.block_size))
    hashes = tuple(hashlib.md5(f"{seed}/{p}".encode()).digest() for p in range(pages))
    return ChunkIdentity(geometry, namespace, hashes, tokens)


def make_payload(identity: ChunkIdentity, seed: int = 0) -> bytes:
    """Activation-like K/V bytes: small normal values in the geometry's dtype."""
    n = identity.payload_nbytes // identity.geometry.dtype.itemsize
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.5
    return values.to(identity.geometry.dtype).view(torch.uint8).numpy().tobytes()


# The crash writer's chunks: 4 pages of 4 KiB, 4 chunks (64 KiB) per transaction.
CRASH_GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=1, head_dim=64, block_size=4, dtype=torch.float16)
CRASH_BATCH = 4
CRASH_MAP_SIZE = 256 << 20
CRASH_READY_AFTER = 20  # batches committed before the writer says "ready"


def crash_chunk(batch: int, index: int) -> tuple[bytes, ChunkIdentity, bytes]:
    """Key, identity and frame of chunk `index` of `batch`."""
    seed = batch * CRASH_BATCH + index
    identity = make_identity(4, geometry=CRASH_GEOMETRY, seed=seed)
    return identity.block_hashes[-1], identity, encode_frame(identity, make_payload(identity, seed))


def write_batches_forever(path: str, first_batch: int) -> None:
    """Writes batch after batch until killed; prints "ready" once a few are committed."""
    store = DiskStore(path, map_size=CRASH_MAP_SIZE)
    for batch in itertools.count(first_batch):
        chunks = [crash_chunk(batch, i) for i in range(CRASH_BATCH)]
        assert store.put_many([(key, frame) for key, _, frame in chunks])
        if batch == first_batch + CRASH_READY_AFTER:
            print("ready", flush=True)

