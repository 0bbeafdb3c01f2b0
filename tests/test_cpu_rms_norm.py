"""The CPU RMS norm kernel (C, built on first use) against torch's rms_norm rounded to bfloat16, and the model's
choice of it (16-bit modes only: float32 keeps torch's ops, the exact path)."""

import pytest
import torch
import torch.nn.functional as F

from kvtierd.kernels.cpu_rms_norm import PARALLEL_MIN_VALUES, cpu_rms_norm_kernel
from kvtierd.model.llama import rms_norm


@pytest.fixture(scope="module")
def kernel():
    k = cpu_rms_norm_kernel()
    if k is None:
        pytest.skip("no C compiler here: the model keeps torch's ops")
    return k


@pytest.mark.parametrize("rows", [1, 7, PARALLEL_MIN_VALUES // 576 + 3])  # the last runs on every thread
def test_rows_are_normed_as_torch_norms_them(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 600, generator=gen) * 4
    h = wide[:, 10:586]  # strided rows, as a slice of the residual stream
    weight = torch.randn(576, generator=gen)
    out = kernel(h, weight, 1e-5)
    expected = F.rms_norm(h, (576,), weight, 1e-5)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 576)
    # float32 sums in another order, one rounding to bfloat16: at most one bfloat16 step from torch's
    assert torch.allclose(out.float(), expected, rtol=2**-7, atol=1e-6)
    assert (out != expected.bfloat16()).float().mean() < 0.01


def test_bad_inputs_are_refused_before_the_kernel_reads_them(kernel):
    with pytest.raises(ValueError):
        kernel(torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError):
        kernel(torch.randn(2, 8), torch.randn(9), 1e-5)


def test_the_model_norms_through_it_in_bfloat16_only(kernel):
    h, weight = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(rms_norm(h, weight, 1e-5, torch.bfloat16, kernel), kernel(h, weight, 1e-5))
    assert torch.equal(rms_norm(h, weight, 1e-5, torch.float32, kernel), F.rms_norm(h, (64,), weight, 1e-5))
