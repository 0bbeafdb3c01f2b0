"""The device tier's bytes: per-layer K and V pools of fixed-size pages.

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
        # Zero-filled so a page never exposes an earlier tenant's bytes.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=g.dtype, device=device), torch.zeros(shape, dtype=g.dtype, device=device))
            for _ in range(g.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole pages `src -> dst` in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
