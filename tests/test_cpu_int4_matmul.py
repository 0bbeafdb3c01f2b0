"""The int4 matmul kernel (C, built on first use for AMX or AVX512-BF16) against the product written out in
float64 over the weights its build computes with (AMX: the dense bfloat16 copy; AVX512-BF16: the quantized
weights unrounded), and its layout against the codes the quantizer chose."""

import pytest
import torch

from kvtierd.kernels.cpu_int4_matmul import cpu_int4_matmul_kernel, tile_codes
from kvtierd.model.quantized import TORCH_INT4_MAX_ROWS, quantize


@pytest.fixture(scope="module")
def kernel():
    k = cpu_int4_matmul_kernel()
    if k is None:
        pytest.skip("no AVX512-BF16 (or no C compiler) here: int4 steps keep torch's kernels")
    return k


def unrounded_weights(q) -> torch.Tensor:
    """`[out, in]` float64: scale * (code - 8) + offset, from the kernel's layout and the scales."""
    tiles = tile_codes(q.packed)  # [out / 16, in / 32, pair, output]
    codes = torch.stack([tiles & 15, tiles >> 4], dim=-1).permute(0, 3, 1, 2, 4).reshape(q.dense.shape).double()
    scale, offset = (q.scales[..., i].double().t().repeat_interleave(32, dim=1) for i in (0, 1))
    return scale * (codes - 8) + offset


def test_the_layout_holds_the_quantizers_codes():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (192, 96), generator=gen, dtype=torch.int32)
    tiles = tile_codes(torch._convert_weight_to_int4pack_for_cpu(codes, 1))
    # [out / 16, in / 32, pair, output]: low nibble input 2p, high nibble 2p + 1
    assert tiles.shape == (12, 3, 16, 16)
    for o, k in [(0, 0), (0, 1), (17, 33), (191, 95), (64, 40), (100, 2)]:
        byte = tiles[o // 16, k // 32, (k % 32) // 2, o % 16].item()
        assert (byte >> 4 * (k % 2)) & 15 == codes[o, k].item(), (o, k)


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 33, 48, 49, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_match_the_dense_copy_written_out(kernel, rows, threads):
    gen = torch.Generator().manual_seed(rows * 10 + threads)
    q = quantize(torch.randn(320, 160, generator=gen) * 0.05, "int4", torch.bfloat16)
    wide = torch.randn(rows, 200, generator=gen).bfloat16()
    x = wide[:, 20:180]  # strided rows, as a split hands them over
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel.matmul(x, tile_codes(q.packed), q.scales)
    finally:
        torch.set_num_threads(before)
    weights = q.dense.double() if kernel.isa == "amx" else unrounded_weights(q)
    expected = x.double() @ weights.t()
    # Those weights exactly, float32 sums, one rounding to bfloat16 at the end.
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 320)
    assert torch.allclose(out.double(), expected, atol=1e-3, rtol=2**-8)


def test_the_int4_matmul_takes_the_kernel_past_torchs_rows_only(kernel):
    gen = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(128, 64, generator=gen) * 0.05, "int4", torch.bfloat16)
    tiled = type(q)(q.kind, q.packed, q.scales, q.dense, tile_codes(q.packed), kernel)
    for rows in (1, TORCH_INT4_MAX_ROWS, TORCH_INT4_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        torch_path = q.matmul(x, True).double()
        # Two bfloat16 roundings apart (and on AMX the kernel rounds the weights to bfloat16 first).
        assert torch.allclose(tiled.matmul(x, True).double(), torch_path, atol=4e-3, rtol=2**-6)
    # The kernel's path is taken past the threshold only.
    x = torch.randn(8, 64, generator=gen).bfloat16()
    assert torch.equal(tiled.matmul(x, True), kernel.matmul(x, tiled.tile_codes, q.scales))
    assert torch.equal(tiled.matmul(x[:1], True), q.matmul(x[:1], True))
