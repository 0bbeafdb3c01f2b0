"""The CPU RMS norm kernel (`cpu/rms_norm.c`): the float32 residual stream normed and rounded to bfloat16 in
one call instead of torch's seven ops, for the 16-bit modes. Built for the host CPU on first use
(`cpu_build.py`); without a compiler the model keeps torch's ops."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvtierd.kernels.cpu_build import build_kernel, loaded_once

# Values below which a call runs on one thread (a decode step's rows: waking a second costs more).
PARALLEL_MIN_VALUES = 1 << 15

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class CpuRmsNorm:
    """`kvt_rms_norm_bf16`."""

    def __init__(self, library: Path) -> None:
        self._fn = ctypes.CDLL(str(library)).kvt_rms_norm_bf16
        self._fn.restype = None
        self._fn.argtypes = [_P, _I64, _P, _I64, _P, _I32, _I32, _F32, _I32]

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`h [n, hidden]` float32 normed, times `weight [hidden]` float32, as a new bfloat16 tensor."""
        if not (h.dtype == weight.dtype == torch.float32 and h.dim() == 2 and h.stride(1) == 1
                and weight.is_contiguous() and weight.shape[0] == h.shape[1]):  # the kernel reads raw memory
            raise ValueError("the CPU RMS norm takes float32 rows and a float32 weight of their width")
        n, hidden = h.shape
        out = torch.empty(n, hidden, dtype=torch.bfloat16)
        threads = torch.get_num_threads() if n * hidden >= PARALLEL_MIN_VALUES else 1
        self._fn(out.data_ptr(), out.stride(0), h.data_ptr(), h.stride(0), weight.data_ptr(), n, hidden, eps, threads)
        return out


@loaded_once
def cpu_rms_norm_kernel() -> CpuRmsNorm | None:
    """The kernel, built (or found built) now; None where it cannot be (torch's ops then)."""
    library = build_kernel("rms_norm.c")
    return CpuRmsNorm(library) if library is not None else None
