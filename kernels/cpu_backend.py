"""The CPU attention path of the 16-bit modes: decodes through the C kernel (`cpu_decode.py`), prefills as the
torch reference attends them (SDPA over gathered pages: large, compute-bound calls that gain nothing here)."""

from __future__ import annotations

import torch

from kvtierd.kernels import reference
from kvtierd.kernels.cpu_decode import CpuDecodeKernel
from kvtierd.kernels.paged_batch import PagedBatch


def build_plan(batch: PagedBatch) -> reference.ReferencePlan:
    return reference.ReferencePlan.build(batch, group_decodes=False)


def attention(kernel: CpuDecodeKernel):
    """`paged_attention(plan, q, k_cache, v_cache, scale)` with the decodes on `kernel` (bfloat16 q and cache)."""

    def paged_attention(plan: reference.ReferencePlan, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        batch = plan.batch
        nd = batch.num_decodes
        out = q.new_empty(q.shape)
        if nd:
            kernel.decode(out[:nd], q[:nd], k_cache, v_cache, batch.block_tables, batch.context_lens,
                          batch.context_lens_host[:nd], scale)
        if nd < q.shape[0]:
            reference.attend_prefills(plan, q, k_cache, v_cache, scale, out)
        return out

    return paged_attention
