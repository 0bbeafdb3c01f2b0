"""Torch reference for paged attention: the CPU path and the CUDA kernels' oracle.

K/V are read only through block tables and written only through the slot
mapping; no contiguous per-sequence cache exists anywhere. The gather indices
are built once per step (`ReferencePlan`) and reused by every layer.

Cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtierd.kernels.paged_batch import PagedBatch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters new K/V `[num_tokens, kv_heads, head_dim]` into their slots (cast to the cache's dtype)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _blocks(block_table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """The pages holding a sequence's first `num_tokens` tokens, from its block table row(s), as int64."""
    return block_table[..., : -(-num_tokens // block_size)].to(torch.int64)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """`[..., num_tokens, kv_heads, head_dim]` of the pages `blocks [..., n]`, in `dtype`. Whole pages are
    gathered (one contiguous page per index, not one token) and the unused tail of the last is cut off."""
    pages = cache.index_select(0, blocks.flatten()).to(dtype)
    return pages.view(*blocks.shape[:-1], -1, *cache.shape[2:])[..., :num_tokens, :, :]


@dataclass(slots=True)
class ReferencePlan:
    batch: PagedBatch
    decode_blocks: torch.Tensor  # [num_decodes, pages of the longest] int64
    decode_ctx: int  # the longest decode context
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, decode_ctx] bool, True where attended; None: all
    prefill_blocks: list[torch.Tensor]  # per prefill sequence: [its pages] int64

    @classmethod
    def build(cls, batch: PagedBatch) -> "ReferencePlan":
        nd = batch.num_decodes
        bs = batch.block_size
        decode_ctx = max(batch.context_lens_host[:nd], default=0)
        decode_blocks = _blocks(batch.block_tables[:nd], decode_ctx, bs)
        decode_mask = None
        if len(set(batch.context_lens_host[:nd])) > 1:  # padding only when lengths differ
            positions = torch.arange(decode_ctx, device=batch.context_lens.device)
            decode_mask = (positions < batch.context_lens[:nd, None]).view(nd, 1, 1, decode_ctx)
        prefill_blocks = [
            _blocks(batch.block_tables[i], batch.context_lens_host[i], bs) for i in range(nd, batch.num_seqs)
        ]
        return cls(batch, decode_blocks, decode_ctx, decode_mask, prefill_blocks)


def paged_attention(
    plan: ReferencePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of `q [num_tokens, heads, head_dim]` over each sequence's pages.

    K/V are read in the cache's dtype and computed with in q's (a no-op cast when they agree).

    Query token j of a sequence with q_len new tokens and context_len cached
    tokens sits at position context_len - q_len + j and sees positions <= its own.
    """
    batch = plan.batch
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(q.shape)

    nd = batch.num_decodes
    if nd:
        # One query per sequence: one padded attention call over the gathered pages.
        qd = q[:nd].unsqueeze(2)  # [nd, heads, 1, head_dim]
        kd = _gather(k_cache, plan.decode_blocks, plan.decode_ctx, q.dtype).transpose(1, 2)  # [nd, kv_heads, ctx, head_dim]
        vd = _gather(v_cache, plan.decode_blocks, plan.decode_ctx, q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
        if nd == num_tokens:
            return od.view(nd, num_heads, head_dim)
        out[:nd] = od.view(nd, num_heads, head_dim)

    start = nd  # decodes hold exactly one token each
    for i, blocks in enumerate(plan.prefill_blocks, start=nd):
        q_len, ctx = batch.query_lens_host[i], batch.context_lens_host[i]
        qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        ki = _gather(k_cache, blocks, ctx, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
        vi = _gather(v_cache, blocks, ctx, q.dtype).transpose(0, 1).unsqueeze(0)
        if q_len == ctx:
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Bottom-right aligned causal mask: the new tokens follow the cached prefix.
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = oi.squeeze(0).transpose(0, 1)
        start += q_len
    assert start == num_tokens, "query_start_loc disagrees with q"
    return out
