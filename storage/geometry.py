"""The shape of one KV page, shared by every tier that stores pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BLOCK_SIZE = 256


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per page
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 and {MAX_BLOCK_SIZE}, got {self.block_size}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block
