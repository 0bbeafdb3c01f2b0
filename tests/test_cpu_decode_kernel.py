"""The CPU decode kernel (C, built on first use) against attention written out in float64, and against the
torch reference on the same batch: decodes of very different contexts beside a prefill chunk."""

import shutil

import numpy as np
import pytest
import torch
from paged_fixtures import scattered_batch

from kvtierd.kernels import cpu_backend, reference
from kvtierd.kernels.backend import select_backend
from kvtierd.kernels.cpu_decode import cpu_decode_kernel

BLOCK, KV_HEADS, HEADS = 16, 3, 9


@pytest.fixture(scope="module", autouse=True)
def _compiler():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the model keeps the torch path (checked by test_the_backend_*)")


def _naive_decode(q, k, v, scale):
    """`q [heads, dim]` over `k, v [ctx, kv_heads, dim]`, float64."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,khd->hk", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", probs, v)


@pytest.mark.parametrize("dim, threads", [(64, 1), (64, 2), (128, 2)])
def test_decodes_attend_as_written_out(dim, threads):
    gen = torch.Generator().manual_seed(dim + threads)
    k_cache = torch.randn(600, BLOCK, KV_HEADS, dim, generator=gen).bfloat16()
    v_cache = torch.randn(600, BLOCK, KV_HEADS, dim, generator=gen).bfloat16()
    # Long rows span several of the kernel's 512-token segments (one ends exactly at one, one just past it).
    context_lens = [40, 2100, 1, 1000, 17, 3000, 512, 513]
    n = len(context_lens)
    batch, tables = scattered_batch(context_lens, [1] * n, n, BLOCK, 600, gen)
    qkv = torch.randn(n, HEADS + 2 * KV_HEADS, dim, generator=gen).bfloat16()
    q = qkv[:, :HEADS]  # strided rows, as the model hands them over
    out = torch.empty(n, HEADS, dim, dtype=torch.bfloat16)
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_decode_kernel(dim).decode(out, q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                      context_lens, scale)
    finally:
        torch.set_num_threads(before)
    for i, ctx in enumerate(context_lens):
        ids = torch.tensor(tables[i])
        k = k_cache[ids].reshape(-1, KV_HEADS, dim)[:ctx]
        v = v_cache[ids].reshape(-1, KV_HEADS, dim)[:ctx]
        expected = _naive_decode(q[i], k, v, scale)
        # float32 arithmetic, one rounding to bfloat16 at the end: within half a bfloat16 step of the exact value
        assert torch.allclose(out[i].double(), expected, atol=2e-3, rtol=2**-8), f"sequence {i}"


def test_an_empty_context_attends_to_nothing_and_yields_zeros():
    k_cache = torch.randn(8, BLOCK, KV_HEADS, 64).bfloat16()
    v_cache = torch.randn(8, BLOCK, KV_HEADS, 64).bfloat16()
    tables = torch.tensor([[0, 0], [3, 5]], dtype=torch.int32)
    q = torch.randn(2, HEADS, 64).bfloat16()
    out = torch.full_like(q, 7.0)
    cpu_decode_kernel(64).decode(out, q, k_cache, v_cache, tables, torch.tensor([0, 20], dtype=torch.int32),
                                 [0, 20], 0.125)
    assert (out[0] == 0).all()
    expected = _naive_decode(q[1], k_cache[[3, 5]].reshape(-1, KV_HEADS, 64)[:20],
                             v_cache[[3, 5]].reshape(-1, KV_HEADS, 64)[:20], 0.125)
    assert torch.allclose(out[1].double(), expected, atol=2e-3, rtol=2**-8)


def test_a_mixed_step_matches_the_torch_reference_and_the_backend_is_chosen_for_16_bit_kv():
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(600, BLOCK, KV_HEADS, 64, generator=gen).bfloat16()
    v_cache = torch.randn(600, BLOCK, KV_HEADS, 64, generator=gen).bfloat16()
    context_lens, query_lens = [40, 1000, 45, 130, 64], [1, 1, 1, 30, 64]
    batch, _ = scattered_batch(context_lens, query_lens, 3, BLOCK, 600, gen)
    q = torch.randn(sum(query_lens), HEADS, 64, generator=gen).bfloat16()
    # the decode kernel's backend (the prefill kernel's, where the CPU has one, is tested with it)
    backend = cpu_backend.attention(cpu_decode_kernel(64))
    assert select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 64).name.startswith("cpu-c-decode")
    out = backend(cpu_backend.build_plan(batch), q, k_cache, v_cache, 0.125)
    expected = reference.paged_attention(reference.ReferencePlan.build(batch), q, k_cache, v_cache, 0.125)
    assert torch.allclose(out[:3].float(), expected[:3].float(), atol=1e-2)  # each rounded to bfloat16 once
    assert torch.equal(out[3:], expected[3:])  # prefills: the reference's own path
    assert cpu_backend.build_plan(batch).decode_groups == []


def test_float32_keeps_the_exact_torch_path():
    assert select_backend(torch.device("cpu"), torch.float32, torch.float32, 64).name == "torch-reference"
    assert select_backend(torch.device("cpu"), torch.bfloat16, torch.float32, 64).name == "torch-reference"
    assert select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 80).name == "torch-reference"


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    # Built with -ffast-math; linked with it, gcc's start-up code would make this thread flush subnormals to zero.
    assert cpu_decode_kernel(64) is not None
    tiny = np.array([0x000AE398], dtype=np.uint32).view(np.float32)  # ~1e-39: subnormal, made from its bits
    # compared as bits: flushing would also flush a comparison's operands (and a conversion from 1e-39)
    assert (tiny * np.float32(1.0)).view(np.uint32)[0] == 0x000AE398


def test_a_layout_the_kernel_cannot_read_is_refused_not_read():
    kernel = cpu_decode_kernel(64)
    cache = torch.zeros(4, BLOCK, KV_HEADS, 64, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q = torch.zeros(1, HEADS, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.decode(out, q, cache.transpose(1, 2), cache, tables, lens, [1], 0.125)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.decode(out, q.float(), cache, cache, tables, lens, [1], 0.125)
