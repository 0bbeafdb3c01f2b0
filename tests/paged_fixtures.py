"""Paged batches for the attention tests: each sequence's pages drawn at random from a pool, so no two sit side
by side by luck."""

from __future__ import annotations

import torch

from kvtierd.kernels.paged_batch import PagedBatch


def scattered_batch(context_lens: list[int], query_lens: list[int], num_decodes: int, block: int, num_pages: int,
                    gen: torch.Generator) -> tuple[PagedBatch, list[list[int]]]:
    """The batch, and each sequence's page ids; sequence i's `query_lens[i]` new tokens are its last ones."""
    pages = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block)
        tables.append(pages[used : used + n])
        used += n
    slots = [tables[i][(ctx - query_lens[i] + j) // block] * block + (ctx - query_lens[i] + j) % block
             for i, ctx in enumerate(context_lens) for j in range(query_lens[i])]
    return PagedBatch.build(block, num_decodes, query_lens, context_lens, tables, slots, torch.device("cpu")), tables
