"""`kvtierd bench cpu-matmul`: a step's matrix products in the int4 mode on the CPU, by the step's rows (tokens).

`TORCH_INT4_MAX_ROWS` (model/quantized.py) is how many rows torch's int4 kernel takes before our tile kernel
(`kernels/cpu_int4_matmul.py`, AMX or AVX512-BF16) does. One row per row count: the whole set of matrices (the
bundled model's 120 layer matrices) through torch's int4 kernel, through the tile kernel, and through the dense
bfloat16 copies, in one process at torch's threads, each path's time the median of its repeats. Before timing,
the tile kernel's products are checked against torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from kvtierd.bench.report import median_time
from kvtierd.model.loader import LoadedModel
from kvtierd.model.quantized import INT4_GROUP, TORCH_INT4_MAX_ROWS, QuantizedLinear

# Of the largest product: two bfloat16 roundings apart, and AMX rounds the weights to bfloat16 first.
TOLERANCE = 2e-2


@dataclass(frozen=True, slots=True)
class CpuMatmulRow:
    rows: int
    torch_int4_ms: float
    tile_kernel_ms: float | None  # None: no tile kernel on this CPU
    dense_ms: float  # the bfloat16 copies


def layer_matrices(loaded: LoadedModel) -> list[QuantizedLinear]:
    """The model's int4 layer matrices (q/k/v, o, gate/up, down of every layer)."""
    matrices = [m for layer in loaded.model.weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if not all(isinstance(m, QuantizedLinear) and m.kind == "int4" for m in matrices):
        raise RuntimeError("bench cpu-matmul needs the model in the int4 mode (the CPU's default)")
    return matrices


def run_cpu_matmul_bench(matrices: Sequence[QuantizedLinear], rows: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 16, 32),
                         repeats: int = 7) -> dict:
    kernel = matrices[0].tile_kernel
    gen = torch.Generator().manual_seed(0)
    figures = []
    for n in rows:
        xs = [torch.randn(n, m.scales.shape[0] * INT4_GROUP, generator=gen).bfloat16() for m in matrices]
        if kernel is not None:
            first, x = matrices[0], xs[0]
            expected = torch._weight_int4pack_mm_for_cpu(x, first.packed, INT4_GROUP, first.scales).float()
            error = (kernel.matmul(x, first.tile_codes, first.scales).float() - expected).abs().max().item()
            if error > TOLERANCE * expected.abs().max().item():
                raise RuntimeError(f"the tile kernel disagrees with torch's int4 kernel at {n} rows; not timing")
        torch_s = median_time(lambda: [torch._weight_int4pack_mm_for_cpu(x, m.packed, INT4_GROUP, m.scales)
                                       for m, x in zip(matrices, xs)], repeats)
        tile_s = None if kernel is None else median_time(
            lambda: [kernel.matmul(x, m.tile_codes, m.scales) for m, x in zip(matrices, xs)], repeats)
        dense_s = median_time(lambda: [m.matmul(x, quantized=False) for m, x in zip(matrices, xs)], repeats)
        figures.append(CpuMatmulRow(n, torch_s * 1e3, None if tile_s is None else tile_s * 1e3, dense_s * 1e3))
    return {"matrices": len(matrices), "tile_kernel": None if kernel is None else kernel.isa,
            "threads": torch.get_num_threads(), "torch_int4_max_rows": TORCH_INT4_MAX_ROWS,
            "torch_faster_up_to": _torch_faster_up_to(figures), "rows": [asdict(r) for r in figures]}


def _torch_faster_up_to(figures: list[CpuMatmulRow]) -> int | None:
    """The most rows up to which torch's int4 kernel beat the tile kernel at every row count timed (None: no tile
    kernel here)."""
    if not figures or figures[0].tile_kernel_ms is None:
        return None
    best = 0
    for r in figures:
        if r.torch_int4_ms > r.tile_kernel_ms:
            break
        best = r.rows
    return best
