"""The CPU attention path of the 16-bit modes: decodes through the C decode kernel (`cpu_decode.py`); prefills
through the C prefill kernel (`cpu_prefill.py`) where the CPU has AVX512-BF16, else as the torch reference
attends them (SDPA over gathered pages)."""

from __future__ import annotations

import torch

from kvtierd.kernels import reference
from kvtierd.kernels.cpu_decode import CpuDecodeKernel
from kvtierd.kernels.cpu_prefill import CpuPrefillKernel
from kvtierd.kernels.paged_batch import PagedBatch


def build_plan(batch: PagedBatch) -> reference.ReferencePlan:
    return reference.ReferencePlan.build(batch, group_decodes=False)


def attention(kernel: CpuDecodeKernel):
    """`paged_attention(plan, q, k_cache, v_cache, scale)` with the decodes on `kernel` (bfloat16 q and cache)."""

    def paged_attention(plan: reference.ReferencePlan, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        out = q.new_empty(q.shape)
        _decodes(kernel, plan.batch, q, k_cache, v_cache, scale, out, plan.batch.num_decodes)
        if plan.batch.num_decodes < q.shape[0]:
            reference.attend_prefills(plan, q, k_cache, v_cache, scale, out)
        return out

    return paged_attention


def kernel_plan(batch: PagedBatch) -> PagedBatch:
    """Both kernels read the batch as it is: no plan to build."""
    return batch


def kernel_attention(decode: CpuDecodeKernel, prefill: CpuPrefillKernel):
    """`paged_attention(batch, q, k_cache, v_cache, scale)` with the decodes on `decode` and each prefill
    sequence on `prefill` (bfloat16 q and cache), but for one of a single token (the last of a prompt found
    whole in the cache), which is a decode: the decode kernel reads its keys and values once for all query
    heads, where the prefill kernel gathers each KV head's keys for its rows (5.8 against 3.6 ms over 30
    layers of 2,560 tokens, `kvtierd bench cpu-attention`). Such tokens
    right after the decodes go in the decodes' call: the threads share the long context's segments and the
    short ones' in one parallel region, where a call of their own left one thread idle at the end of each
    (three short decodes are 3 items on 2 threads) and started a region more per layer."""

    def paged_attention(batch: PagedBatch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        scale: float) -> torch.Tensor:
        out = q.new_empty(q.shape)
        start = _single_tokens(batch)  # sequences (and rows) of one token each, from the first
        _decodes(decode, batch, q, k_cache, v_cache, scale, out, start)
        for i in range(start, batch.num_seqs):
            rows = slice(start, start + batch.query_lens_host[i])
            if batch.query_lens_host[i] == 1:  # a cached prompt's last token: a decode, split over the threads
                decode.decode(out[rows], q[rows], k_cache, v_cache, batch.block_tables[i : i + 1],
                              batch.context_lens[i : i + 1], batch.context_lens_host[i : i + 1], scale)
            else:
                prefill.attend(out[rows], q[rows], k_cache, v_cache, batch.block_tables[i],
                               batch.context_lens_host[i], scale)
            start = rows.stop
        assert start == q.shape[0], "query_start_loc disagrees with q"
        return out

    return paged_attention


def _single_tokens(batch: PagedBatch) -> int:
    """How many sequences from the first hold one token each: the decodes, then any prefill of one token."""
    n = batch.num_decodes
    while n < batch.num_seqs and batch.query_lens_host[n] == 1:
        n += 1
    return n


def _decodes(kernel: CpuDecodeKernel, batch: PagedBatch, q: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, scale: float, out: torch.Tensor, n: int) -> None:
    """The first `n` sequences, one token each, in one kernel call."""
    if n:
        kernel.decode(out[:n], q[:n], k_cache, v_cache, batch.block_tables[:n], batch.context_lens[:n],
                      batch.context_lens_host[:n], scale)
