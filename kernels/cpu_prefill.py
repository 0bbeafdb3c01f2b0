"""The CPU prefill attention kernel (`cpu/paged_prefill.c`): a run of new tokens over a sequence's cached
pages (a chat turn over its history, a prefill chunk over the chunks before it), built for the host CPU on
first use (`cpu_build.py`, once per head_dim), called by ctypes.

The torch path gathers the pages into a copy and runs SDPA with a mask; the kernel reads them in place,
once per KV head for every query head and token of a block. It needs AVX512-BF16; elsewhere the build
fails and the model keeps the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvtierd.kernels.cpu_build import build_kernel, cpu_flags, loaded_once

HEAD_DIMS = (64, 128)  # built on demand, one library each

# A run that makes fewer items than this a thread (few tokens: 3 KV heads' items on 2 threads) has its keys split
# into segments, so both threads work and each reads few keys ahead of its passes.
SPLIT_BELOW_ITEMS_PER_THREAD = 4

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I64, _F32, _I32, _I32]


class CpuPrefillKernel:
    """`kvt_paged_prefill_bf16` for one head_dim."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).kvt_paged_prefill_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = _ARGTYPES

    def attend(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               table: torch.Tensor, ctx: int, scale: float, split: bool = True) -> None:
        """Attention of `q [q_len, heads, head_dim]`, the last q_len of the sequence's `ctx` tokens in the pages
        `table [pages]` (int32), into `out` (same shape; rows of both may be strided). bfloat16 throughout.
        `split` False: no run's keys go in segments (`kvtierd bench cpu-attention` sets it beside the default)."""
        q_len, num_heads, head_dim = q.shape
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
                and table.dtype == torch.int32 and table.is_contiguous()
                and q.stride(1) == out.stride(1) == head_dim and q.stride(2) == out.stride(2) == 1
                and k_cache.is_contiguous() and v_cache.is_contiguous()):  # the kernel reads raw memory
            raise ValueError("CPU prefill attention takes bfloat16 rows of contiguous heads, contiguous page "
                             "pools and an int32 page table")
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        status = self._fn(out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                          v_cache.data_ptr(), table.data_ptr(), ctx, q_len, num_heads, num_kv_heads, block_size,
                          num_blocks * block_size, scale, torch.get_num_threads(),
                          SPLIT_BELOW_ITEMS_PER_THREAD if split else 0)
        if status != 0:
            raise MemoryError("CPU prefill attention: no memory for its state, more than 16 query heads share "
                              "a KV head, or a page pool too large for its 32-bit offsets")


@loaded_once
def cpu_prefill_kernel(head_dim: int) -> CpuPrefillKernel | None:
    """The kernel for `head_dim`, built (or found built) now; None where it cannot be (the torch path then)."""
    if head_dim not in HEAD_DIMS or b"avx512_bf16" not in cpu_flags().split():
        return None
    library = build_kernel("paged_prefill.c", (f"-DHEAD_DIM={head_dim}",))
    return CpuPrefillKernel(library) if library is not None else None
