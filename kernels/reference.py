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
class DecodeGroup:
    """Decodes of similar context length, attended in one padded call (padding costs a gather and the
    attention over it: a 40-token context beside a 1,000-token one would read 25x its own KV)."""

    rows: torch.Tensor | None  # [n] int64: their rows among the decodes; None: all decodes, in order
    blocks: torch.Tensor  # [n, pages of the longest] int64
    ctx: int  # the longest context
    mask: torch.Tensor | None  # [n, 1, 1, ctx] bool, True where attended; None: all


@dataclass(slots=True)
class ReferencePlan:
    batch: PagedBatch
    decode_groups: list[DecodeGroup]
    prefill_blocks: list[torch.Tensor]  # per prefill sequence: [its pages] int64
    # per prefill sequence: its causal mask [q_len, ctx] (True: attended) when it follows a cached prefix
    # (else None), built once a step rather than in each layer
    prefill_masks: list[torch.Tensor | None]
    # the same masks as SDPA adds them (`additive_mask`), made by the first layer
    additive_masks: dict[tuple[int, int], torch.Tensor]

    @classmethod
    def build(cls, batch: PagedBatch, group_decodes: bool = True) -> "ReferencePlan":
        """`group_decodes=False`: the decodes are attended elsewhere (the CPU kernel), only the prefills here."""
        nd = batch.num_decodes
        groups = _decode_groups(batch.context_lens_host[:nd]) if group_decodes else []
        decode_groups = [_decode_group(batch, None if len(groups) == 1 else rows) for rows in groups]
        bs = batch.block_size
        prefills = range(nd, batch.num_seqs)
        prefill_blocks = [_blocks(batch.block_tables[i], batch.context_lens_host[i], bs) for i in prefills]
        masks = [_prefix_causal_mask(batch.query_lens_host[i], batch.context_lens_host[i], batch.block_tables.device)
                 for i in prefills]
        return cls(batch, decode_groups, prefill_blocks, masks, {})

    def additive_mask(self, i: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Prefill sequence i's mask as 0 (attended) or -inf in `dtype`: SDPA turns a boolean mask into this
        in every call (each layer), ~a sixth of a chat turn's attention. With `group` > 1, for its queries
        grouped by KV head (`_grouped_queries`): row r * q_len + t is query t's row, for each of the
        `group` query heads r of a KV head."""
        mask = self.additive_masks.get((i, group))
        if mask is None:
            allowed = self.prefill_masks[i].repeat(group, 1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            self.additive_masks[(i, group)] = mask
        return mask


def _prefix_causal_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor | None:
    """Bottom-right aligned causal mask `[q_len, ctx]` (True: attended): the new tokens follow the cached
    prefix. None when nothing is cached (SDPA's own causal mask covers it)."""
    if q_len == ctx:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (ctx - q_len)
    return torch.arange(ctx, device=device).unsqueeze(0) <= rows


def _decode_groups(context_lens: list[int], min_span: int = 64) -> list[list[int]]:
    """Decode rows in groups by context length, shortest first: a group takes contexts up to twice (and at
    least `min_span` past) its shortest, so padding at most doubles what a group reads."""
    groups: list[list[int]] = []
    for row in sorted(range(len(context_lens)), key=context_lens.__getitem__):
        shortest = context_lens[groups[-1][0]] if groups else 0
        if groups and context_lens[row] <= max(2 * shortest, shortest + min_span):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _decode_group(batch: PagedBatch, rows: list[int] | None) -> DecodeGroup:
    lens = batch.context_lens_host[: batch.num_decodes] if rows is None else [batch.context_lens_host[r] for r in rows]
    index = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=batch.context_lens.device)
    tables = batch.block_tables[: batch.num_decodes] if index is None else batch.block_tables.index_select(0, index)
    ctx = max(lens)
    mask = None
    if len(set(lens)) > 1:  # padding only when lengths differ
        context = batch.context_lens[: batch.num_decodes] if index is None else \
            batch.context_lens.index_select(0, index)
        mask = (torch.arange(ctx, device=context.device) < context[:, None]).view(len(lens), 1, 1, ctx)
    return DecodeGroup(index, _blocks(tables, ctx, batch.block_size), ctx, mask)


# A prefill over a cached prefix groups its query heads (`_grouped_queries`) up to this many rows a KV head
# (48 tokens for SmolLM2's 3 query heads a KV head). Measured (SDPA alone, bfloat16, one thread, the same
# values): 5 tokens over 200 1.32-1.41x faster, 35 over 300 1.32x, 35 over 1,535 1.22-1.27x, 47 over 1,535
# 1.09x; 64 over 1,000 or 1,535 0.86-0.87x and 128 over 1,000 0.76-0.89x: slower.
GROUPED_MAX_ROWS = 144


def _grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`q [q_len, heads, head_dim]` as `[1, kv_heads, group * q_len, head_dim]`: the query heads that share a
    KV head (HF's repeat_kv order: head h reads KV head h // group) become rows of one head, attended in
    one pass over that KV head's keys rather than one pass per query head (`enable_gqa`)."""
    q_len, heads, head_dim = q.shape
    return q.view(q_len, kv_heads, heads // kv_heads, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, head_dim)


def paged_attention(
    plan: ReferencePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of `q [num_tokens, heads, head_dim]` over each sequence's pages.

    K/V are read in the cache's dtype and computed with in q's (a no-op cast when they agree).

    Query token j of a sequence with q_len new tokens and context_len cached
    tokens sits at position context_len - q_len + j and sees positions <= its own.
    """
    nd = plan.batch.num_decodes
    if len(plan.decode_groups) == 1 and nd == q.shape[0]:
        return _attend_group(plan.decode_groups[0], q, k_cache, v_cache, scale)  # decodes only: no copy into out
    out = q.new_empty(q.shape)
    for g in plan.decode_groups:
        od = _attend_group(g, q[:nd], k_cache, v_cache, scale)
        if g.rows is None:
            out[:nd] = od
        else:
            out.index_copy_(0, g.rows, od)
    attend_prefills(plan, q, k_cache, v_cache, scale, out)
    return out


def _attend_group(g: DecodeGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One query per sequence: one padded attention call over the group's gathered pages. (Grouping the
    query heads, as prefills do, measured slower for a single query: 0.3-0.8x.)"""
    qd = (q if g.rows is None else q.index_select(0, g.rows)).unsqueeze(2)  # [n, heads, 1, head_dim]
    kd = _gather(k_cache, g.blocks, g.ctx, q.dtype).transpose(1, 2)  # [n, kv_heads, ctx, head_dim]
    vd = _gather(v_cache, g.blocks, g.ctx, q.dtype).transpose(1, 2)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True).squeeze(2)


def attend_prefills(plan: ReferencePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, out: torch.Tensor) -> None:
    """The prefill sequences' rows of `out` (those after the decodes)."""
    batch = plan.batch
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    nd = batch.num_decodes
    start = nd  # decodes hold exactly one token each
    for i, (blocks, mask) in enumerate(zip(plan.prefill_blocks, plan.prefill_masks, strict=True), start=nd):
        q_len, ctx = batch.query_lens_host[i], batch.context_lens_host[i]
        ki = _gather(k_cache, blocks, ctx, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
        vi = _gather(v_cache, blocks, ctx, q.dtype).transpose(0, 1).unsqueeze(0)
        if mask is None or q_len * group > GROUPED_MAX_ROWS:
            qi = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            added = None if mask is None else plan.additive_mask(i - nd, 1, q.dtype)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=added, is_causal=mask is None, scale=scale,
                                                enable_gqa=True)
            out[start : start + q_len] = oi.squeeze(0).transpose(0, 1)
        else:  # a short run of new tokens over a cached prefix (a chat turn)
            qi = _grouped_queries(q[start : start + q_len], kv_heads)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=plan.additive_mask(i - nd, group, q.dtype),
                                                scale=scale)
            out[start : start + q_len] = oi.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
                q_len, num_heads, head_dim)
        start += q_len
    assert start == num_tokens, "query_start_loc disagrees with q"
