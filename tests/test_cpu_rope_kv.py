"""The CPU RoPE/KV-write kernel (C, built on first use) against the rotation written out in float64 and the
model's own tables, and the caches it writes against the slots it was given."""

import pytest
import torch

from kvtierd.kernels.cpu_rope_kv import PARALLEL_MIN_TOKENS, cpu_rope_kv_kernel
from kvtierd.model.loader import load_model
from kvtierd.model.rope import RotaryEmbedding

Q_HEADS, KV_HEADS, DIM = 9, 3, 64


@pytest.fixture(scope="module")
def kernel():
    k = cpu_rope_kv_kernel()
    if k is None:
        pytest.skip("no C compiler here: the model keeps torch's ops")
    return k


@pytest.fixture(scope="module")
def rope():
    return RotaryEmbedding(load_model(None, "cpu", "float32").config, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("n", [1, 35, PARALLEL_MIN_TOKENS + 5])  # the last runs on every thread
def test_heads_rotate_as_written_out_and_kv_lands_in_its_slots(kernel, rope, n):
    gen = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (Q_HEADS + 2 * KV_HEADS) * DIM, generator=gen).bfloat16()
    cos, signed_sin = rope.tables(torch.randint(0, 8000, (n,), generator=gen))
    k_cache = torch.zeros(200, 16, KV_HEADS, DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(3200, generator=gen)[:n]
    rotated = qkv.clone()
    kernel(rotated, cos, signed_sin, slots, k_cache, v_cache, Q_HEADS)

    heads = qkv[:, : (Q_HEADS + KV_HEADS) * DIM].view(n, -1, DIM).double()
    half = DIM // 2
    exact = heads * cos.double() + torch.cat([heads[..., half:], heads[..., :half]], dim=-1) * signed_sin.double()
    got = rotated[:, : (Q_HEADS + KV_HEADS) * DIM].view(n, -1, DIM)
    # float32 arithmetic, one rounding to bfloat16: within half a bfloat16 step of the exact value
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6)
    assert torch.equal(rotated[:, (Q_HEADS + KV_HEADS) * DIM :], qkv[:, (Q_HEADS + KV_HEADS) * DIM :])  # v as it was
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM), v_cache.view(-1, KV_HEADS, DIM)
    assert torch.equal(flat_k[slots], got[:, Q_HEADS:])
    assert torch.equal(flat_v[slots], qkv[:, (Q_HEADS + KV_HEADS) * DIM :].view(n, KV_HEADS, DIM))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].count_nonzero() == 0 and flat_v[untouched].count_nonzero() == 0


def test_bad_inputs_are_refused_before_the_kernel_touches_memory(kernel, rope):
    cos, signed_sin = rope.tables(torch.tensor([3, 4]))
    k_cache = torch.zeros(4, 16, KV_HEADS, DIM, dtype=torch.bfloat16)
    qkv = torch.zeros(2, (Q_HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError):  # float32 rows
        kernel(qkv.float(), cos, signed_sin, slots, k_cache, k_cache.clone(), Q_HEADS)
    with pytest.raises(ValueError):  # int32 slots
        kernel(qkv, cos, signed_sin, slots.int(), k_cache, k_cache.clone(), Q_HEADS)
    with pytest.raises(ValueError):  # rows of another width than the heads say
        kernel(qkv[:, 64:], cos, signed_sin, slots, k_cache, k_cache.clone(), Q_HEADS)
