"""The torch reference attention over pages, against attention written out by hand in float64."""

import torch
from paged_fixtures import scattered_batch

from kvtierd.kernels import reference

BLOCK, KV_HEADS, HEADS, DIM = 16, 3, 9, 64


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`q [q_len, heads, dim]` over `k, v [ctx, kv_heads, dim]`, the new tokens last (causal), float64."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(ctx)[None, :] <= (torch.arange(q_len)[:, None] + ctx - q_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_decodes_of_very_different_contexts_and_a_prefill_chunk_attend_as_written_out():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(400, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(400, BLOCK, KV_HEADS, DIM, generator=gen)
    # Five decodes (short and long contexts, interleaved) and a 30-token chunk after 100 cached tokens.
    context_lens = [40, 1000, 45, 2100, 1, 130]
    query_lens = [1, 1, 1, 1, 1, 30]
    batch, tables = scattered_batch(context_lens, query_lens, 5, BLOCK, 400, gen)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    plan = reference.ReferencePlan.build(batch)
    assert len(plan.decode_groups) == 3  # {1, 40, 45}, {1000}, {2100}: no short context padded to a long one

    out = reference.paged_attention(plan, q, k_cache, v_cache, DIM**-0.5)

    start = 0
    for i, ctx in enumerate(context_lens):
        ids = torch.tensor(tables[i])
        k = k_cache[ids].reshape(-1, KV_HEADS, DIM)[:ctx]
        v = v_cache[ids].reshape(-1, KV_HEADS, DIM)[:ctx]
        expected = _naive(q[start : start + query_lens[i]], k, v, DIM**-0.5)
        assert torch.allclose(out[start : start + query_lens[i]].double(), expected, atol=1e-5), f"sequence {i}"
        start += query_lens[i]
