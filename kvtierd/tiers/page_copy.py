"""Copies between device pages and a chunk's KV laid out for the lower tiers.

    chunk KV  [layers, 2 (K, V), pages, block_size, kv_heads, head_dim]
    device    per layer K and V  [num_blocks, block_size, kv_heads, head_dim]

A chunk's pages are wherever the pool put them. Out of a CPU pool, each
layer's K and V move in one `index_select`, however scattered the pages: a
copy per run of consecutive pages cost a torch call per page of a scattered
chunk (16 scattered pages, 30 layers, one thread: 13.7 ms against 1.2 ms).
Out of a CUDA pool, each run of consecutive page ids is one slice copy per
layer and K/V. Into a pool, each run is one slice copy per group of layers
(the pool is one tensor): into a CPU pool `index_copy_` measured 2.4x slower
than a slice copy for consecutive pages, which a load's fresh pages usually
are. A group's bytes are hashed right after its copy read them; a load that
need not yield to steps copies every layer in one group, a paced one
PACED_SLICE_BYTES a group (a slice each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.tiers.background_work import BACKGROUND_WORK

# A paced load copies and hashes this much of a chunk a slice (~0.5 ms on one core): a chunk's layers one at a
# time cost 30 slices of Python and torch calls for 6 MB (4.5 ms against 1 ms for its copy in one piece, probe).
PACED_SLICE_BYTES = 3 << 20


class PageCopier:
    def __init__(self, device: DeviceKVPool) -> None:
        self._device = device
        self.geometry = device.geometry

    def shape(self, num_pages: int) -> tuple[int, ...]:
        g = self.geometry
        return (g.num_layers, 2, num_pages, g.block_size, g.num_kv_heads, g.head_dim)

    def byte_shape(self, num_pages: int) -> tuple[int, ...]:
        """`shape` of the same KV seen as bytes: a payload at any offset in a buffer can be viewed so."""
        *outer, head_dim = self.shape(num_pages)
        return (*outer, head_dim * self.geometry.dtype.itemsize)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The pages' K and V in chunk layout, copied to CPU memory."""
        out = torch.empty(self.shape(len(block_ids)), dtype=self.geometry.dtype)
        self.gather_into(out, block_ids)
        return out

    def gather_into(self, out: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copies the pages' K and V into `out` (CPU, chunk layout, contiguous)."""
        if self._device.device.type == "cpu":
            index = torch.tensor(block_ids, dtype=torch.int64)
            for layer, (k, v) in enumerate(self._device.kv_caches):
                torch.index_select(k, 0, index, out=out[layer, 0])
                torch.index_select(v, 0, index, out=out[layer, 1])
            return
        runs = page_runs(block_ids)
        for layer, (k, v) in enumerate(self._device.kv_caches):
            for at, first, n in runs:
                out[layer, 0, at : at + n].copy_(k[first : first + n])
                out[layer, 1, at : at + n].copy_(v[first : first + n])

    def scatter(self, kv: torch.Tensor, skip: int, block_ids: Sequence[int], payload: memoryview | None = None) -> int:
        """Writes pages `skip`.. of `kv` (chunk layout, in the pool's dtype or as bytes: `byte_shape`) into the
        device pages `block_ids`. With `payload` (kv's bytes), returns the payload's xxh3_64, each group of layers
        hashed right after the copy read it, while in cache. A load that yields to steps works a group of
        layers (PACED_SLICE_BYTES) a slice; any other copies every layer at once."""
        dev = self._device
        pool = dev.kv if kv.dtype == dev.kv.dtype else dev.kv.view(kv.dtype)  # bytes: a payload need not be aligned
        runs = page_runs(block_ids)
        layer_bytes = kv[0].numel() * kv.element_size()
        group = max(1, PACED_SLICE_BYTES // layer_bytes) if BACKGROUND_WORK.pacing() else len(pool)
        hasher = xxhash.xxh3_64()
        payload_layer = len(payload) // len(pool) if payload is not None else 0
        try:
            for start in range(0, len(pool), group):
                layers = slice(start, start + group)
                for at, first, n in runs:
                    pool[layers, :, first : first + n].copy_(kv[layers, :, skip + at : skip + at + n],
                                                             non_blocking=True)
                if payload is not None:
                    hasher.update(payload[start * payload_layer : (start + group) * payload_layer])
                BACKGROUND_WORK.pace()  # raises TaskAbandoned when nobody wants the load any more
        finally:
            if dev.device.type == "cuda":
                torch.cuda.current_stream(dev.device).synchronize()  # the source may be rewritten once we return
        return hasher.intdigest()


def page_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in `block_ids`, first page id, length) of each run of consecutive page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs
