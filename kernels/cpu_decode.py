"""The CPU decode attention kernel (`cpu/paged_decode.c`): built for the host CPU on first use
(`cpu_build.py`, once per head_dim), called by ctypes.

Decode attention is where the torch path spends most of a decode step once
contexts grow: it gathers each sequence's pages into a copy and runs SDPA over
it. The C kernel reads the pages in place, once per KV head. Without a
compiler the model keeps the torch path (`kvtierctl status` names the backend
in use).

The kernel shares its (KV head, context segment) items among OpenMP threads, as many
as torch computes with at the call (`engine/step_threads.py` may leave one to
the tiers), or one for a call too small to pay for waking the others.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvtierd.kernels.cpu_build import build_kernel, loaded_once

HEAD_DIMS = (64, 128)  # built on demand, one library each
MAX_GROUP = 16  # the kernel's bound on query heads per KV head
# Context tokens x KV heads below which a call runs on one thread: ~35 ns each, so a smaller call costs less
# than waking a second thread and joining it (a short chat's decode).
PARALLEL_MIN_WORK = 1024

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I32, _I32, _I32, _F32, _I32]


class CpuDecodeKernel:
    """`kvt_paged_decode_bf16` for one head_dim."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).kvt_paged_decode_bf16
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = _ARGTYPES

    def decode(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, context_lens_host: list[int],
               scale: float) -> None:
        """Attention of the decode rows `q [n, heads, head_dim]` (rows may be strided) into `out` (contiguous,
        same shape): row s over the pages `block_tables[s]`, `context_lens[s]` tokens. bfloat16 throughout."""
        n, num_heads, head_dim = q.shape
        if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
                and block_tables.dtype == context_lens.dtype == torch.int32
                and q.stride(1) == head_dim and q.stride(2) == 1 and out.is_contiguous()
                and k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
                and context_lens.is_contiguous()):  # the kernel reads raw memory in exactly these layouts
            raise ValueError("CPU decode attention takes bfloat16 rows of contiguous heads, contiguous page pools "
                             "and int32 block tables")
        num_kv_heads = k_cache.shape[2]
        threads = torch.get_num_threads() if sum(context_lens_host) * num_kv_heads >= PARALLEL_MIN_WORK else 1
        status = self._fn(out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), n, num_heads,
                          num_kv_heads, k_cache.shape[1], scale, threads)
        if status != 0:
            raise MemoryError(f"CPU decode attention: no memory for its scores, or more than {MAX_GROUP} query "
                              "heads share a KV head")


@loaded_once
def cpu_decode_kernel(head_dim: int) -> CpuDecodeKernel | None:
    """The kernel for `head_dim`, built (or found built) now; None where it cannot be (the torch path then)."""
    if head_dim not in HEAD_DIMS:
        return None
    library = build_kernel("paged_decode.c", (f"-DHEAD_DIM={head_dim}",))
    return CpuDecodeKernel(library) if library is not None else None
