"""The CPU int4 matmul kernel (`cpu/int4_matmul.c`): steps of a few to a few dozen rows in the int4 mode.

torch's int4 kernel costs ~2 ms a row over the bundled model's matrices, and the bfloat16 copies read 4x
the bytes, so a step of 4 to 48 tokens (a decode batch, a chat turn's new tokens, a prefill chunk cut to a
step budget) paid for one or the other. This kernel reads each weight once a step for many rows. Measured
over the bundled model's 120 matrices (2 threads), against the bfloat16 copies:
- AMX (Intel Sapphire Rapids): ~14 ms flat from 4 to 32 rows against 22-37 ms;
- AVX512-BF16 (AMD Zen 5): 5.7 ms at 4 rows, 6.7 at 8, 12 at 16, 15 at 24, against 9.9, 11.4, 13 and 15.6.
torch's kernel stays the faster for 1-3 rows.

It is built for AMX-BF16 where the CPU has it (Intel Sapphire Rapids and later), else for AVX512-BF16 (AMD
Zen 4 and later); without either, the model keeps torch's kernels. The weights go to it in a layout of its own (`tile_codes`), made once at load from torch's packed
int4 matrix (the same codes).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvtierd.kernels.cpu_build import build_kernel, cpu_flags, loaded_once

log = logging.getLogger(__name__)

OUTPUTS_PER_SLICE = 16  # the kernel's tile width
GROUP = 32  # inputs per (scale, offset)
TORCH_BLOCK = 64  # outputs per block of torch's packed layout

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Rows up to which each build beats the bfloat16 copies (measured as above): AMX tiles take 48 rows a pass;
# the AVX-512 build's cost per row is the GEMM's, so it pays until the weights' bytes stop mattering.
MAX_ROWS = {"amx": 48, "avx512_bf16": 24}


class CpuInt4Matmul:
    """`kvt_int4_matmul`."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self._fn = lib.kvt_int4_matmul
        self._fn.restype = None
        self._fn.argtypes = [_P, _I64, _P, _I64, _P, _P, _I32, _I32, _I32, _I32]
        lib.kvt_int4_isa.restype = ctypes.c_char_p
        self.isa: str = lib.kvt_int4_isa().decode()  # "amx" or "avx512_bf16": the instructions it was built for
        self.max_rows = MAX_ROWS[self.isa]  # the largest step it is faster for
        if lib.kvt_int4_init() != 0:
            raise OSError("the kernel asked Linux for AMX's tile state and was refused")

    def matmul(self, x: torch.Tensor, tile_codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """`x [m, in]` bfloat16 -> `[m, out]` bfloat16, against the matrix whose codes `tile_codes` holds (this
        kernel's layout) and torch's int4 `scales` `[in / 32, out, 2]`."""
        if not (x.dtype == scales.dtype == torch.bfloat16 and tile_codes.dtype == torch.uint8
                and scales.is_contiguous() and tile_codes.is_contiguous()):  # the kernel reads raw memory
            raise ValueError("the int4 tile kernel takes bfloat16 rows and scales and its own uint8 layout")
        if x.stride(-1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = scales.shape[1]
        out = x.new_empty(m, n)
        self._fn(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), tile_codes.data_ptr(), scales.data_ptr(),
                 m, n, k, torch.get_num_threads())
        return out


def tile_codes(packed: torch.Tensor) -> torch.Tensor:
    """torch's packed int4 matrix `[out, in / 2]` (`_convert_weight_to_int4pack_for_cpu`: for each block of
    64 outputs and each input, 32 bytes, byte j holding output j's code and output j + 32's) in this
    kernel's layout: for each 16 outputs, each group of 32 inputs, each input pair p, 16 bytes, byte i
    holding output i's code for input 2p (low nibble) and 2p + 1 (high nibble)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // TORCH_BLOCK, k, TORCH_BLOCK // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(n, k)  # [out, in], 0..15
    pairs = codes.view(n // OUTPUTS_PER_SLICE, OUTPUTS_PER_SLICE, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def fits(out_features: int, in_features: int) -> bool:
    """Whether a matrix of this shape has the kernel's layout (and torch's packed one)."""
    return out_features % TORCH_BLOCK == 0 and in_features % GROUP == 0


@loaded_once
def cpu_int4_matmul_kernel() -> CpuInt4Matmul | None:
    """The kernel, built (or found built) now; None where it cannot be (the torch kernels then)."""
    if b"avx512_bf16" not in cpu_flags().split():
        log.info("no AVX512-BF16 on this CPU: int4 steps keep torch's kernels")
        return None
    library = build_kernel("int4_matmul.c")
    if library is None:
        return None
    try:
        return CpuInt4Matmul(library)
    except OSError as e:
        log.warning("the int4 matmul kernel cannot run here, keeping torch's kernels: %s", e)
        return None
