"""What attention needs to know about one engine step, as tensors.

Sequences are ordered decodes first: the first `num_decodes` sequences have
exactly one query token each, the rest are prefill chunks (many query tokens,
possibly over a cached prefix). Token t of the flattened batch belongs to the
sequence i with query_start_loc[i] <= t < query_start_loc[i + 1].

    context_lens[i]  tokens of sequence i in the cache after this step's writes
    block_tables[i]  its page ids, padded with 0 past its last page (never read)
    slot_mapping[t]  page * block_size + offset where token t's K/V are written
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    block_size: int
    num_decodes: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_context_len: int
    # Host copies for the reference path's per-sequence loop (no device syncs).
    query_lens_host: list[int]
    context_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @classmethod
    def build(
        cls,
        block_size: int,
        num_decodes: int,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device,
    ) -> "PagedBatch":
        assert len(query_lens) == len(context_lens) == len(block_tables)
        assert all(q == 1 for q in query_lens[:num_decodes]), "decodes come first, one token each"
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            block_size=block_size,
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            max_context_len=max(context_lens, default=0),
            query_lens_host=list(query_lens),
            context_lens_host=list(context_lens),
        )
