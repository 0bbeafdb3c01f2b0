"""Zeroed host tensors on transparent huge pages, where the kernel grants them.

The device pool on a CPU host is read page by page in whatever order the page
tables give: with 4 KiB pages each KV page costs TLB misses and restarts the
hardware prefetcher. Backed by 2 MiB pages (`madvise(MADV_HUGEPAGE)`, which a
kernel in the common "madvise" mode needs), decode attention over a
2,560-token context scattered in the pool took 6.3 ms instead of 9.7 (30
layers, 2 threads; `kvtierd bench kernels`). The kernel zero-fills the
mapping, so no page exposes an earlier tenant's bytes.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of `shape` in an anonymous mapping advised to use huge pages (a plain one where
    the platform has no such advice). The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype).view(shape)
