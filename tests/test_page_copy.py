"""A chunk's KV into device pages: a load that yields to steps copies it a group of layers a slice, one that need
not in one piece; either way the pages hold the chunk's pages from `skip` on, nothing else changes, and the
returned hash is the payload's."""

import torch
import xxhash
from test_paced_loads import Lender

from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.page_copy import PACED_SLICE_BYTES, PageCopier

# 1 MiB a layer for a 64-page chunk: a paced copy goes in groups of three layers, the last one alone.
GEOMETRY = KVGeometry(num_layers=7, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
CHUNK_PAGES = 64
SKIP = 5
# Two runs of consecutive pages and a lone one, out of order.
BLOCK_IDS = [*range(40, 70), *range(3, 31), 90]


def _payload(copier: PageCopier) -> memoryview:
    """A chunk's payload, at an odd offset in its buffer (as in a stored frame)."""
    kv = torch.randn(copier.shape(CHUNK_PAGES), generator=torch.Generator().manual_seed(7)).to(GEOMETRY.dtype)
    return memoryview(b"\x01" * 3 + kv.reshape(-1).view(torch.uint8).numpy().tobytes())[3:]


def _scatter(paced: bool) -> tuple[DeviceKVPool, int, bool]:
    """Scatters the payload on a transfer worker of the process's pacing, while an engine computes (a thread
    lends the workers time, as a step loop does) or not; returns the pool, the hash and whether it was paced."""
    pool = DeviceKVPool(GEOMETRY, 100, torch.device("cpu"))
    copier = PageCopier(pool)
    payload = _payload(copier)
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(copier.byte_shape(CHUNK_PAGES))
    workers = BACKGROUND_WORK.paced_pool(1, "test-page-copy")
    lender = None
    if paced:
        BACKGROUND_WORK.engine_computes(True)
        lender = Lender(BACKGROUND_WORK)
    try:
        checksum, was_paced = workers.submit(
            lambda: (copier.scatter(kv, SKIP, BLOCK_IDS, payload), BACKGROUND_WORK.pacing())).result(timeout=60)
    finally:
        if lender is not None:
            lender.stop()
            BACKGROUND_WORK.engine_computes(False)
        workers.shutdown(wait=True)
    return pool, checksum, was_paced


def test_a_paced_copy_and_a_copy_in_one_piece_write_the_same_pages_and_hash():
    layer_bytes = GEOMETRY.bytes_per_block * CHUNK_PAGES // GEOMETRY.num_layers
    assert 2 * layer_bytes <= PACED_SLICE_BYTES < GEOMETRY.num_layers * layer_bytes, "paced: groups of a few layers"
    copier = PageCopier(DeviceKVPool(GEOMETRY, 1, torch.device("cpu")))
    chunk = torch.frombuffer(bytearray(_payload(copier)), dtype=GEOMETRY.dtype).view(copier.shape(CHUNK_PAGES))
    payload = _payload(copier)
    for paced in (False, True):
        pool, checksum, was_paced = _scatter(paced)
        assert was_paced == paced
        assert checksum == xxhash.xxh3_64_intdigest(payload)
        expected = torch.zeros_like(pool.kv)
        expected[:, :, BLOCK_IDS] = chunk[:, :, SKIP : SKIP + len(BLOCK_IDS)]
        assert torch.equal(pool.kv, expected)
