"""`kvtierd bench cpu-matmul`: a small run over real int4 matrices, the tile kernel checked against torch's first."""

from __future__ import annotations

import torch

from kvtierd.bench.cpu_matmul_bench import run_cpu_matmul_bench
from kvtierd.kernels.cpu_int4_matmul import cpu_int4_matmul_kernel, tile_codes
from kvtierd.model.quantized import TORCH_INT4_MAX_ROWS, quantize


def test_a_small_cpu_matmul_bench_times_every_path():
    gen = torch.Generator().manual_seed(3)
    kernel = cpu_int4_matmul_kernel()
    matrices = []
    for out_features, in_features in ((128, 64), (192, 128)):
        q = quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, "int4", torch.bfloat16)
        if kernel is not None:
            q = type(q)(q.kind, q.packed, q.scales, q.dense, tile_codes(q.packed), kernel)
        matrices.append(q)
    f = run_cpu_matmul_bench(matrices, rows=(1, 5), repeats=1)
    assert f["matrices"] == 2 and f["torch_int4_max_rows"] == TORCH_INT4_MAX_ROWS
    assert [r["rows"] for r in f["rows"]] == [1, 5]
    for r in f["rows"]:
        assert min(r["torch_int4_ms"], r["dense_ms"]) > 0
        assert (r["tile_kernel_ms"] is None) == (kernel is None)
    assert (f["tile_kernel"] is None) == (kernel is None) and (f["torch_faster_up_to"] is None) == (kernel is None)
