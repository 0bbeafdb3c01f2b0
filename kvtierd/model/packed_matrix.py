"""bfloat16 matrices reordered once into oneDNN's blocked layout, for CPU matmuls.

torch's bfloat16 `F.linear` on CPU runs oneDNN's matmul (AMX or AVX-512), which first reorders the
weight into its blocked layout, on every call: for a step of a few to a few thousand tokens that
reorder is a third of the time or more. Reordering each matrix once, at load, and calling the
blocked kernel directly (`mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch's own
compiler does for a frozen CPU model) computes the same values 1.3-1.9x faster (measured over the
bundled model's 120 matrices, one thread, 1 to 2,048 rows). float32 keeps MKL's sgemm: its path is
the exact one every logits-equality test runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The row count the blocked layout is tuned for; any count works. Small steps (decodes and mixed steps
# of a few dozen tokens) are where the time goes, and past a few rows the choice barely matters.
PACKED_FOR_ROWS = 32


@dataclass(slots=True)
class PackedMatrix:
    """A `[out, in]` bfloat16 matrix in oneDNN's blocked layout (an mkldnn tensor)."""

    weight: torch.Tensor

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x [n, in] -> [n, out]` (+ bias)."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, bias, "none", [], "")

    def to_dense(self) -> torch.Tensor:
        """The plain `[out, in]` tensor (a layout change: the values are the same)."""
        return self.weight.to_dense()

    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether bfloat16 matrices on `device` run faster packed: a CPU whose oneDNN has bfloat16 kernels."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: torch.Tensor) -> PackedMatrix:
    return PackedMatrix(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACKED_FOR_ROWS))
