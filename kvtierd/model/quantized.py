"""Weight-only quantized matrices: int8 per output channel, or 4-bit groups kept packed.

A step of a few tokens (decode) is bound by the bytes of weights it reads, so it runs torch's
quantized CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which read 1/2 or
1/4 of bfloat16's bytes. A step of many tokens (prefill) is bound by arithmetic, where those
kernels are several times slower than the bfloat16 GEMM, so each matrix is also kept dense in
bfloat16 holding the same (dequantized) values: both paths compute with one set of weights.

torch's int4 kernel pays ~0.75-2 ms a row (over the bundled model's matrices); on a CPU with AVX512-BF16, an
int4 matrix also gets the layout of our own kernel (`kernels/cpu_int4_matmul.py`), which takes the
rows past `TORCH_INT4_MAX_ROWS` of a small step at a cost nearly flat in rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtierd.kernels.cpu_int4_matmul import CpuInt4Matmul
from kvtierd.model.packed_matrix import PackedMatrix

INT4_GROUP = 32  # weights per 4-bit group: llama.cpp's Q4_0/Q4_1 block
# Rows up to which torch's int4 kernel beats ours (measured over the bundled model's matrices, 2 threads:
# Sapphire Rapids 7 ms at 1 row, 13 at 4, against AMX tiles' ~14 flat; Zen 5 3.5 at 1, 5.3 at 4, against
# AVX512-BF16's 4.4 and 5.7; `kvtierd bench cpu-matmul` on a later Xeon: 5.2 at 1, 8.1 at 4 and 13.2 at 5,
# against AMX's 10.0-11.0). Three streams and a cached prompt's last token make 4.
TORCH_INT4_MAX_ROWS = 4


@dataclass(slots=True)
class QuantizedLinear:
    """A `[out, in]` matrix of a weight-only quantized mode."""

    kind: str  # "int8" or "int4"
    packed: torch.Tensor  # int8: [out, in] int8; int4: torch's packed uint8 [out, in / 2]
    scales: torch.Tensor  # int8: [out]; int4: [in / INT4_GROUP, out, 2] (scale, offset); compute dtype
    # [out, in] compute dtype: the dequantized values, for large steps (packed on a CPU that runs them faster)
    dense: torch.Tensor | PackedMatrix
    # int4 on a CPU with AVX512-BF16: the codes in our kernel's layout, and the kernel (made at load, not cached)
    tile_codes: torch.Tensor | None = None
    tile_kernel: CpuInt4Matmul | None = None

    def matmul(self, x: torch.Tensor, quantized: bool) -> torch.Tensor:
        """`x [n, in] -> [n, out]`; `quantized` picks the weight-streaming kernel (small steps)."""
        if not quantized:
            if isinstance(self.dense, PackedMatrix):
                return self.dense.matmul(x)
            return torch.nn.functional.linear(x, self.dense)
        if self.kind == "int8":
            return torch._weight_int8pack_mm(x, self.packed, self.scales)
        if self.tile_kernel is not None and x.shape[0] > TORCH_INT4_MAX_ROWS:
            return self.tile_kernel.matmul(x, self.tile_codes, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scales)

    def num_bytes_streamed(self) -> int:
        """Bytes a quantized matmul reads: the packed weights and their scales."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(w: torch.Tensor, kind: str, compute_dtype: torch.dtype) -> QuantizedLinear:
    """Quantizes a float matrix `[out, in]`. The scales are rounded to the compute dtype first and the
    codes chosen against the rounded scales, so the kernel's dequantization is the one intended."""
    w = w.float()
    if kind == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(compute_dtype)
        codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127)
        dense = codes * scales.float()[:, None]
        return QuantizedLinear(kind, codes.to(torch.int8), scales, dense.to(compute_dtype))
    if kind == "int4":
        out_features, in_features = w.shape
        assert in_features % INT4_GROUP == 0, "int4 needs the input size to be a multiple of the group"
        groups = w.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        scale, offset, codes = _int4_params(groups, compute_dtype)
        dense = ((codes - 8) * scale[..., None] + offset[..., None]).view(out_features, in_features)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.view(out_features, in_features).to(torch.int32), 1)
        scales = torch.stack([scale.t(), offset.t()], dim=-1).to(compute_dtype).contiguous()
        return QuantizedLinear(kind, packed, scales, dense.to(compute_dtype))
    raise ValueError(f"unknown quantization {kind!r}")


def _int4_params(groups: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's scale and offset, as values of `dtype` (float32 tensors), and its codes 0..15.

    Asymmetric, like Q4_1: value = scale * code + low, code in 0..15. torch's kernel computes
    scale * (code - 8) + offset, so offset = low + 8 * scale. Both are held in `dtype`: rounding them
    to bfloat16 alone would triple the matrix's error (a Q4_1 group's values would not come back),
    so of the representable values either side of each, the pair that reconstructs the group best is
    kept (measured on SmolLM2: relative error 0.42% -> 0.19%, bfloat16's own rounding being 0.13%)."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for s in _representable_around(scale, dtype):
        for o in _representable_around(low + 8 * scale, dtype):
            codes = torch.round((groups - o[..., None]) / s[..., None] + 8).clamp(0, 15)
            err = ((codes - 8) * s[..., None] + o[..., None] - groups).square().sum(dim=-1)
            if best is None:
                best = (err, s, o, codes)
                continue
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, s, best[1]),
                    torch.where(better, o, best[2]), torch.where(better[..., None], codes, best[3]))
    assert best is not None
    return best[1], best[2], best[3]


def _representable_around(x: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The nearest value of `dtype` to each of `x`, then its neighbours below and above, as float32 (the
    nearest first: a tie keeps it)."""
    nearest = x.to(dtype)
    below = torch.nextafter(nearest, torch.full_like(nearest, float("-inf")))
    above = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    return [nearest.float(), below.float(), above.float()]
