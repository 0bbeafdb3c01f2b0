"""Which attention implementation a model uses: CUDA kernels where they can run; on CPUs, in the 16-bit modes where a
C compiler is found, the C decode kernel, and the C prefill kernel too where the CPU has AVX512-BF16; the torch
reference elsewhere (and always in float32, the exact mode)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtierd.kernels import cpu_backend, reference
from kvtierd.kernels.cpu_decode import cpu_decode_kernel
from kvtierd.kernels.cpu_prefill import cpu_prefill_kernel
from kvtierd.kernels.paged_batch import PagedBatch


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str  # reported by `kvtierctl status`
    build_plan: Callable[[PagedBatch], Any]  # once per step, shared by every layer
    write_kv: Callable[..., None]  # (k_cache, v_cache, k, v, slot_mapping)
    paged_attention: Callable[..., torch.Tensor]  # (plan, q, k_cache, v_cache, scale)


REFERENCE = AttentionBackend("torch-reference", reference.ReferencePlan.build, reference.write_kv,
                             reference.paged_attention)


def select_backend(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """For activations of `dtype` over a KV cache of `kv_dtype`."""
    if device.type == "cuda":
        from kvtierd.kernels import cuda_backend  # imports CuPy lazily; optional extra

        if cuda_backend.cuda_kernels_available():
            return AttentionBackend("cuda-cupy", cuda_backend.CudaPlan.build, cuda_backend.write_kv,
                                    cuda_backend.paged_attention)
    elif dtype == kv_dtype == torch.bfloat16:
        kernel = cpu_decode_kernel(head_dim)
        prefill = cpu_prefill_kernel(head_dim) if kernel is not None else None
        if prefill is not None:
            return AttentionBackend("cpu-c-decode-prefill", cpu_backend.kernel_plan, reference.write_kv,
                                    cpu_backend.kernel_attention(kernel, prefill))
        if kernel is not None:
            return AttentionBackend("cpu-c-decode", cpu_backend.build_plan, reference.write_kv,
                                    cpu_backend.attention(kernel))
    return REFERENCE
