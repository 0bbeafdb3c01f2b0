"""The device tier's bytes: per-layer K and V pools of fixed-size pages, in one tensor.

The pool only holds memory; which page belongs to whom is the block pool's
business (`kvtierd.cache`).
"""

from __future__ import annotations

import torch

from kvtierd.storage.geometry import KVGeometry


# Staging a page copy may take: every layer at once for a few pages, a layer at a time for a compaction's many.
STAGING_BYTES = 64 << 20


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
        page may be the destination of one pair and the source of another. Layers go
        as many at a time as STAGING_BYTES holds: a copy-on-write's single page in one
        gather and one scatter for all layers (two small calls a layer, 120 in all, cost 1-2 ms
        a step)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        layer_bytes = 2 * len(pairs) * self.kv[0, 0, 0].numel() * self.kv.element_size()
        at_once = max(1, min(len(self.kv), STAGING_BYTES // layer_bytes))
        # Allocated once, first: running out of memory here leaves every page as it was.
        staging = torch.empty((at_once, 2, len(pairs), *self.kv.shape[3:]), dtype=self.kv.dtype, device=self.device)
        for start in range(0, len(self.kv), at_once):
            layers = self.kv[start : start + at_once]
            gathered = staging[: len(layers)]
            torch.index_select(layers, 2, src, out=gathered)
            layers.index_copy_(2, dst, gathered)

    def synchronize(self) -> None:
        """Waits for the copies queued so far (CUDA runs them asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
