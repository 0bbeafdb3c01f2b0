"""The CPU rotary-embedding and KV-write kernel (`cpu/rope_kv.c`): a layer's q and k heads rotated in place and
its new keys and values written to their cache slots in one call, for the 16-bit modes (torch: eight ops a
layer). Built for the host CPU on first use (`cpu_build.py`); without a compiler the model keeps torch's ops."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvtierd.kernels.cpu_build import build_kernel, loaded_once

MAX_HEAD_DIM = 512  # the kernel's bound (one head on its stack)
# Tokens below which a call runs on one thread (a decode step's: waking a second costs more).
PARALLEL_MIN_TOKENS = 64

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class CpuRopeKv:
    """`kvt_rope_write_kv`."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).kvt_rope_write_kv
        self._fn.restype = None
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _I32, _I32, _I32, _I32, _I32]

    def __call__(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int) -> None:
        """`qkv [n, (q_heads + 2 * kv_heads) * head_dim]` bfloat16: its q and k heads rotated in place by the
        tables `cos, signed_sin [n, head_dim]` (RotaryEmbedding's), then its k and v heads written to the caches
        `[pages, block_size, kv_heads, head_dim]` at `slots [n]` (int64)."""
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        n = qkv.shape[0]
        if not (qkv.dtype == cos.dtype == signed_sin.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
                and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == n
                and qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (q_heads + 2 * kv_heads) * head_dim
                and cos.is_contiguous() and signed_sin.is_contiguous() and cos.numel() == signed_sin.numel() == n * head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim <= MAX_HEAD_DIM
                and head_dim % 2 == 0):  # the kernel reads and writes raw memory in exactly these layouts
            raise ValueError("the CPU RoPE/KV kernel takes bfloat16 qkv rows, tables and contiguous caches, "
                             "and int64 slots")
        threads = torch.get_num_threads() if n >= PARALLEL_MIN_TOKENS else 1
        self._fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr(), n, q_heads, kv_heads, head_dim, threads)


@loaded_once
def cpu_rope_kv_kernel() -> CpuRopeKv | None:
    """The kernel, built (or found built) now; None where it cannot be (torch's ops then)."""
    library = build_kernel("rope_kv.c")
    return CpuRopeKv(library) if library is not None else None
