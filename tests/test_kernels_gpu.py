"""The CUDA kernels against the torch reference, on random inputs (needs a GPU).

The kernels read fp16/bf16 and accumulate in fp32, so they are compared with
the reference run in fp32 on the very same (already rounded) inputs; what is
left is accumulation order and the final rounding of the output:

    fp32  atol 1e-4, rtol 1e-4
    fp16  atol 2e-3, rtol 2e-3   (half an fp16 ulp is 2.4e-4 relative)
    bf16  atol 1e-2, rtol 1e-2   (half a bf16 ulp is 2e-3 relative)
"""

from __future__ import annotations

import pytest
import torch

from kvtierd.kernels import cuda_backend as cuda
from kvtierd.kernels import reference as ref
from kvtierd.kernels.paged_batch import PagedBatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in TOLERANCE]


def make_batch(query_lens, context_lens, num_decodes, block_size, gen, spare_blocks=3):
    """Sequences on shuffled pages (page 0 never used, as padding points there), plus the pool size."""
    pages_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = 1 + sum(pages_per_seq) + spare_blocks
    pages = (torch.randperm(num_blocks - 1, generator=gen, device="cuda") + 1).tolist()
    tables, slots = [], []
    for q_len, ctx, n in zip(query_lens, context_lens, pages_per_seq, strict=True):
        table, pages = pages[:n], pages[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    batch = PagedBatch.build(block_size, num_decodes, query_lens, context_lens, tables, slots, torch.device("cuda"))
    return batch, num_blocks


def randn(*shape, gen, dtype):
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def check_attention(dtype, heads, kv_heads, head_dim, block_size, query_lens, context_lens, num_decodes,
                    partition_size=cuda.DEFAULT_PARTITION_SIZE, strided_q=False, seed=0):  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch, num_blocks = make_batch(query_lens, context_lens, num_decodes, block_size, gen)
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    num_tokens = sum(query_lens)
    if strided_q:  # as the model's q is: a column slice of the fused qkv projection
        qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
        q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    else:
        q = randn(num_tokens, heads, head_dim, gen=gen, dtype=dtype)
    scale = head_dim**-0.5

    plan = cuda.CudaPlan.build(batch, partition_size=partition_size)
    got = cuda.paged_attention(plan, q, k_cache, v_cache, scale)
    expect = ref.paged_attention(ref.ReferencePlan.build(batch), q.float(), k_cache.float(), v_cache.float(), scale)
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), expect, **TOLERANCE[dtype])
    return plan


# (heads, kv_heads, head_dim, block_size, query_lens, context_lens, num_decodes)
DECODE_CASES = {
    "tiny": (2, 1, 4, 4, [1, 1], [5, 9], 2),
    "block1": (4, 2, 8, 1, [1, 1, 1], [1, 7, 30], 3),
    "block256": (4, 4, 64, 256, [1, 1], [255, 700], 2),
    "smollm2": (9, 3, 64, 16, [1] * 5, [1, 16, 17, 100, 333], 5),
    "llama8b": (32, 8, 128, 16, [1] * 4, [40, 511, 512, 513], 4),
    "head256": (8, 2, 256, 16, [1, 1], [64, 200], 2),
    "odd_dims": (6, 2, 40, 3, [1, 1], [2, 50], 2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_matches_reference(dtype, case):
    check_attention(dtype, *case)


# Long contexts: several partitions per sequence, merged by the reduce kernel.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context_lens", [[3000], [8193, 100, 4096], [20000, 1]])
def test_decode_split_k_matches_reference(dtype, context_lens):
    n = len(context_lens)
    plan = check_attention(dtype, 32, 8, 128, 16, [1] * n, context_lens, n)
    assert plan.num_partitions > 1


@pytest.mark.parametrize("partition_size", [1, 7, 16, 64])
def test_decode_split_k_small_partitions(partition_size):
    check_attention(torch.float32, 4, 2, 32, 4, [1, 1, 1], [1, 37, 64], 3, partition_size=partition_size)


PREFILL_CASES = {
    "prompt": (2, 1, 16, 4, [9], [9], 0),  # q_len == ctx: plain causal
    "chunk_over_prefix": (4, 2, 64, 16, [20], [100], 0),  # bottom-right aligned
    "one_token_chunk": (4, 2, 64, 16, [1, 3], [50, 3], 0),
    "block1": (2, 2, 32, 1, [17, 5], [17, 40], 0),
    "block256": (8, 2, 128, 256, [300, 33], [300, 600], 0),
    "llama8b": (32, 8, 128, 16, [70, 129], [70, 1000], 0),
    "head256": (4, 4, 256, 16, [40], [90], 0),  # over 48 KiB of shared memory: needs the opt-in
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_matches_reference(dtype, case):
    check_attention(dtype, *case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_mixed_decode_and_prefill(dtype, block_size):
    query_lens = [1, 1, 1, 48, 5, 1]
    context_lens = [30, 1500, 700, 48, 260, 17]
    check_attention(dtype, 9, 3, 64, block_size, query_lens, context_lens, 3, strided_q=True)


def test_plan_is_shared_by_layers():
    # Split-K partials are reused across layers; each layer must still get its own answer.
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, num_blocks = make_batch([1, 1, 10], [900, 1200, 30], 2, 16, gen)
    plan = cuda.CudaPlan.build(batch)
    ref_plan = ref.ReferencePlan.build(batch)
    outs, expects = [], []
    for _ in range(3):
        k = randn(num_blocks, 16, 2, 64, gen=gen, dtype=torch.float16)
        v = randn(num_blocks, 16, 2, 64, gen=gen, dtype=torch.float16)
        q = randn(12, 8, 64, gen=gen, dtype=torch.float16)
        outs.append(cuda.paged_attention(plan, q, k, v, 0.125))
        expects.append(ref.paged_attention(ref_plan, q.float(), k.float(), v.float(), 0.125))
    for got, expect in zip(outs, expects):
        torch.testing.assert_close(got.float(), expect, **TOLERANCE[torch.float16])


def test_runs_on_the_current_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        check_attention(torch.float16, 4, 2, 64, 16, [1, 7], [600, 7], 1)
    stream.synchronize()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_write_kv_matches_reference(dtype, block_size):
    gen = torch.Generator(device="cuda").manual_seed(2)
    kv_heads, head_dim, num_blocks = 3, 64, 6
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    num_tokens = min(20, num_blocks * block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    qkv = randn(num_tokens, 5 * kv_heads * head_dim, gen=gen, dtype=dtype)  # k and v as strided slices
    k = qkv[:, 3 * kv_heads * head_dim : 4 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, 4 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    ref.write_kv(k_expect, v_expect, k, v, slots)
    cuda.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 8, device="cuda", dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(2, 1, 8, device="cuda", dtype=torch.float16)
    cuda.write_kv(k_cache, v_cache, k, k, torch.tensor([-1, 5], device="cuda"))
    assert k_cache.view(-1, 8).sum(dim=1).nonzero().flatten().tolist() == [5]


def make_pools(dtype, shape, num_layers=3, seed=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [randn(*shape, gen=gen, dtype=dtype) for _ in range(2 * num_layers)]  # K and V per layer


# Page shapes: 16-byte copy units, and odd pages that fall back to the element size.
PAGE_SHAPES = [(10, 16, 2, 64), (7, 1, 1, 3), (9, 3, 1, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PAGE_SHAPES)
def test_copy_blocks(dtype, shape):
    caches = make_pools(dtype, shape)
    before = [c.clone() for c in caches]
    src, dst = [1, 3, 2], [4, 0, 6]
    cuda.copy_blocks(caches, torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda"))
    for cache, old in zip(caches, before):
        expect = old.clone()
        expect[dst] = old[src]
        assert torch.equal(cache, expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PAGE_SHAPES)
def test_gather_then_scatter_round_trips(dtype, shape):
    caches = make_pools(dtype, shape)
    ids = [5, 0, 2]
    staging = cuda.gather_blocks(caches, ids)
    assert torch.equal(staging, torch.stack([c[ids] for c in caches], dim=1))
    fresh = make_pools(dtype, shape, seed=4)
    cuda.scatter_blocks(fresh, [6, 1, 3], staging)
    for cache, old in zip(fresh, caches):
        assert torch.equal(cache[[6, 1, 3]], old[ids])


def test_argument_checks_reject_bad_layouts():
    batch, num_blocks = make_batch([1], [5], 1, 4, torch.Generator(device="cuda").manual_seed(0))
    plan = cuda.CudaPlan.build(batch)
    cache = torch.zeros(num_blocks, 4, 1, 8, device="cuda", dtype=torch.float16)
    q = torch.zeros(1, 2, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="dtype"):
        cuda.paged_attention(plan, q.float(), cache, cache, 1.0)
    strided = torch.zeros(num_blocks, 4, 1, 16, device="cuda", dtype=torch.float16)[..., :8]
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        cuda.paged_attention(plan, q, strided, strided, 1.0)
    with pytest.raises(RuntimeError, match="contiguous within"):
        cuda.paged_attention(plan, torch.zeros(1, 8, 2, device="cuda", dtype=torch.float16).transpose(1, 2), cache, cache, 1.0)
    with pytest.raises(RuntimeError, match="page id"):
        cuda.copy_blocks([cache], [0], [num_blocks])


def test_compile_error_names_the_kernel(monkeypatch):
    broken = 'extern "C" __global__ void kvtierd_broken() { undefined_name = 1; }'
    monkeypatch.setitem(cuda.KERNEL_FILES, "broken.cu", ("kvtierd_broken",))
    monkeypatch.setattr(cuda, "load_source", lambda filename: broken)
    monkeypatch.setattr(cuda, "_modules", {})
    monkeypatch.setattr(cuda, "_kernels", {})
    with pytest.raises(cuda.KernelCompileError, match=r"kvtierd_broken[\s\S]*undefined_name"):
        cuda._kernel("kvtierd_broken", torch.cuda.current_device())


def test_the_kernel_bench_runs_and_checks_before_timing():
    from kvtierd.bench.kernels import run_kernel_bench

    figures = run_kernel_bench((1, 4), (256, 2048), prefill_shapes=((256, 64),), iters=2, warmup=1,
                               print_fn=lambda _: None)
    assert figures["copy_gbps"] > 0 and len(figures["decode"]) == 4 and len(figures["prefill"]) == 1
    assert all(r["kernel_gbps"] > 0 and r["max_abs_error"] < 1e-2 for r in figures["decode"])
