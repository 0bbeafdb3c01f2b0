"""The CPU prefill attention kernel (C, AVX512-BF16, built on first use) against attention written out in
float64: runs of new tokens over cached pages (a chat turn, a prefill chunk), whole prompts, query heads
per KV head from 1 to 16; and the backend that uses it against the torch reference on a mixed step."""

import pytest
import torch
from paged_fixtures import scattered_batch

from kvtierd.kernels import reference
from kvtierd.kernels.backend import select_backend
from kvtierd.kernels.cpu_decode import cpu_decode_kernel
from kvtierd.kernels.cpu_prefill import cpu_prefill_kernel

BLOCK = 16


@pytest.fixture(scope="module")
def kernel64():
    k = cpu_prefill_kernel(64)
    if k is None:
        pytest.skip("no AVX512-BF16 (or no C compiler) here: prefills keep the torch path")
    return k


def _written_out(q, k, v, scale):
    """`q [q_len, heads, dim]`, the last q_len of the `k, v [ctx, kv_heads, dim]` tokens, each attending to
    the tokens up to its own, in float64."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * scale
    position = torch.arange(q_len).unsqueeze(1) + (ctx - q_len)
    scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > position, float("-inf"))
    return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("ctx, q_len, heads, kv_heads, dim, threads", [
    (1535, 35, 9, 3, 64, 2),     # a chat turn over its history
    (1535, 35, 9, 3, 64, 1),
    (2560, 16, 9, 3, 64, 2),     # a restored request's tail: its keys in segments, merged
    (2560, 4, 9, 3, 64, 1),      # a piece beside decodes, one thread
    (513, 20, 9, 3, 64, 2),      # two blocks in segments: the first sees none of the last, rows past the edge
    (300, 300, 9, 3, 64, 2),     # a whole prompt
    (100, 1, 9, 3, 64, 2),       # one token
    (17, 5, 9, 3, 64, 2),        # the last page partly filled, few keys
    (700, 130, 16, 1, 64, 2),    # 16 query heads on one KV head: 3 tokens an item
    (500, 40, 4, 4, 128, 2),     # no grouping, the other head size
])
def test_runs_of_new_tokens_attend_as_written_out(ctx, q_len, heads, kv_heads, dim, threads):
    gen = torch.Generator().manual_seed(ctx + q_len + heads + dim)
    pages = -(-ctx // BLOCK) + 8
    k_cache = torch.randn(pages, BLOCK, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(pages, BLOCK, kv_heads, dim, generator=gen).bfloat16()
    batch, tables = scattered_batch([ctx], [q_len], 0, BLOCK, pages, gen)
    qkv = torch.randn(q_len, heads + 2 * kv_heads, dim, generator=gen).bfloat16()
    q = qkv[:, :heads]  # strided rows, as the model hands them over
    wide = torch.zeros(q_len, heads + 1, dim, dtype=torch.bfloat16)
    out = wide[:, 1:]  # strided rows out too: nothing outside them is written
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel = cpu_prefill_kernel(dim)
        if kernel is None:
            pytest.skip("no AVX512-BF16 (or no C compiler) here: prefills keep the torch path")
        kernel.attend(out, q, k_cache, v_cache, batch.block_tables[0], ctx, dim**-0.5)
    finally:
        torch.set_num_threads(before)
    ids = torch.tensor(tables[0])
    expected = _written_out(q, k_cache[ids].reshape(-1, kv_heads, dim)[:ctx],
                            v_cache[ids].reshape(-1, kv_heads, dim)[:ctx], dim**-0.5)
    # float32 arithmetic, one rounding to bfloat16 at the end: within about a bfloat16 step of the exact value
    assert torch.allclose(out.double(), expected, atol=2e-3, rtol=2**-7)
    assert torch.count_nonzero(wide[:, 0]) == 0


def test_bad_inputs_are_refused_before_the_kernel_reads_them(kernel64):
    k_cache = torch.zeros(4, BLOCK, 3, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 9, 64, dtype=torch.bfloat16)
    table = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError):
        kernel64.attend(torch.empty_like(q), q.float(), k_cache, k_cache, table, 20, 0.125)
    with pytest.raises(ValueError):
        kernel64.attend(torch.empty_like(q), q, k_cache, k_cache, table.long(), 20, 0.125)
    with pytest.raises(MemoryError):  # 17 query heads on one KV head: past the kernel's bound
        q17, one_head = torch.zeros(2, 17, 64, dtype=torch.bfloat16), k_cache[:, :, :1].contiguous()
        kernel64.attend(torch.empty_like(q17), q17, one_head, one_head, table, 20, 0.125)


def test_the_backend_attends_a_mixed_step_as_the_torch_reference(kernel64):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(600, BLOCK, 3, 64, generator=gen).bfloat16()
    v_cache = torch.randn(600, BLOCK, 3, 64, generator=gen).bfloat16()
    # the fourth prefill is a cached prompt's last token, which the backend hands to the decode kernel
    context_lens, query_lens = [40, 1000, 130, 64, 900, 2600], [1, 1, 30, 64, 16, 1]
    batch, _ = scattered_batch(context_lens, query_lens, 2, BLOCK, 600, gen)
    q = torch.randn(sum(query_lens), 9, 64, generator=gen).bfloat16()
    backend = select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 64)
    assert backend.name == "cpu-c-decode-prefill"
    out = backend.paged_attention(backend.build_plan(batch), q, k_cache, v_cache, 0.125)
    expected = reference.paged_attention(reference.ReferencePlan.build(batch), q, k_cache, v_cache, 0.125)
    assert torch.allclose(out.float(), expected.float(), atol=1e-2)  # each rounded to bfloat16 once


def test_a_cached_prompts_last_token_after_the_decodes_attends_in_their_call_to_the_same_bits(kernel64):
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(600, BLOCK, 3, 64, generator=gen).bfloat16()
    v_cache = torch.randn(600, BLOCK, 3, 64, generator=gen).bfloat16()
    # three decodes, a long cached prompt's last token (the step it joins them in), a chunk of a prompt
    context_lens, query_lens = [200, 180, 220, 2560, 900], [1, 1, 1, 1, 16]
    batch, _ = scattered_batch(context_lens, query_lens, 3, BLOCK, 600, gen)
    q = torch.randn(sum(query_lens), 9, 64, generator=gen).bfloat16()
    backend = select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 64)
    out = backend.paged_attention(backend.build_plan(batch), q, k_cache, v_cache, 0.125)
    expected = reference.paged_attention(reference.ReferencePlan.build(batch), q, k_cache, v_cache, 0.125)
    assert torch.allclose(out.float(), expected.float(), atol=1e-2)
    decode = cpu_decode_kernel(64)
    for i in range(4):  # each single-token row as a call of its own computes: a sequence's parts are its own
        alone = torch.empty_like(q[i : i + 1])
        decode.decode(alone, q[i : i + 1], k_cache, v_cache, batch.block_tables[i : i + 1],
                      batch.context_lens[i : i + 1], batch.context_lens_host[i : i + 1], 0.125)
        assert torch.equal(out[i : i + 1], alone)
