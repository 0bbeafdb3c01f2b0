"""The device pool: zeroed at the start, and its page copies, with layers copied all at once or a few at a
time."""

from __future__ import annotations

import pytest
import torch

from kvtierd.storage import device_pool
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=5, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)


def _filled(pool: DeviceKVPool) -> torch.Tensor:
    pool.kv.copy_(torch.arange(pool.kv.numel()).view(pool.kv.shape).to(pool.kv.dtype))
    return pool.kv.clone()


@pytest.mark.parametrize("staging_bytes", [64 << 20, 1])  # every layer at once; one layer at a time
def test_page_copies_read_every_source_before_writing_any_destination(monkeypatch, staging_bytes):
    monkeypatch.setattr(device_pool, "STAGING_BYTES", staging_bytes)
    pool = DeviceKVPool(GEOMETRY, 8, torch.device("cpu"))
    assert not pool.kv.any()
    before = _filled(pool)
    pairs = [(1, 2), (2, 3), (5, 0)]  # page 2 is both a destination and a source
    pool.copy_blocks(pairs)
    expected = before.clone()
    for src, dst in pairs:
        expected[:, :, dst] = before[:, :, src]
    assert torch.equal(pool.kv, expected)
    assert all(torch.equal(k, pool.kv[i, 0]) and torch.equal(v, pool.kv[i, 1])
               for i, (k, v) in enumerate(pool.kv_caches))  # the per-layer views see the same memory
