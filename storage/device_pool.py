"""The device tier's bytes: per-layer K and V pools of fixed-size pages, in one tensor.

The pool only holds memory; which page belongs to whom is the block pool's
business (`kvtierd.cache`).
"""

from __future__ import annotations

import torch

from kvtierd.storage.geometry import KVGeometry


class DeviceKVPool:
    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> None:
        g = geometry
        shape = (num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.device = device
        # Zero-filled so a page never exposes an earlier tenant's bytes. One tensor [layers, 2 (K, V), *shape],
        # seen per layer: a load writes a run of pages in every layer with one copy (`tiers/page_copy.py`).
        self.kv = torch.zeros((g.num_layers, 2, *shape), dtype=g.dtype, device=device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [(layer[0], layer[1]) for layer in self.kv]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole pages `src -> dst` in every layer (copy-on-write, compaction).

        Each layer's sources are all read before any destination is written, so a
        page may be the destination of one pair and the source of another."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        k0 = self.kv_caches[0][0]
        # Allocated once, first: running out of memory here leaves every page as it was.
        staging = torch.empty((len(pairs), *k0.shape[1:]), dtype=k0.dtype, device=self.device)
        for k, v in self.kv_caches:
            torch.index_select(k, 0, src, out=staging)
            k.index_copy_(0, dst, staging)
            torch.index_select(v, 0, src, out=staging)
            v.index_copy_(0, dst, staging)

    def synchronize(self) -> None:
        """Waits for the copies queued so far (CUDA runs them asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
