"""`kvtierd bench capacity`: how many sequences fit a fixed KV budget.

Paged: each sequence takes ceil(len / block_size) pages from the real
KVCacheManager until a request no longer fits. Contiguous: each sequence
reserves the longest length of the mix up front, as a max-length cache would.
Unused slots are allocated token slots that hold no token.
"""

from __future__ import annotations

import random

from kvtierd.cache.kv_cache_manager import KVCacheManager

MIN_TOKENS, MAX_TOKENS = 20, 4000


def length_mix(n: int, seed: int = 0) -> list[int]:
    """A long-tailed chat mix: most requests short, a few near 4,000 tokens."""
    rng = random.Random(seed)
    return [min(MAX_TOKENS, max(MIN_TOKENS, int(rng.lognormvariate(6.0, 1.0)))) for _ in range(n)]


def paged_fit(lengths: list[int], budget_tokens: int, block_size: int) -> tuple[int, float]:
    """(sequences admitted before the first that does not fit, unused share of allocated slots)."""
    kv = KVCacheManager(budget_tokens // block_size, block_size)
    used = 0
    for i, n in enumerate(lengths):
        if kv.allocate_slots(f"s{i}", n) is None:
            allocated = kv.pool.num_used_blocks * block_size
            return i, 1 - used / allocated
        used += n
    raise ValueError("the length mix is smaller than the budget; give more sequences")


def contiguous_fit(lengths: list[int], budget_tokens: int) -> tuple[int, float]:
    fit = min(budget_tokens // MAX_TOKENS, len(lengths))
    return fit, 1 - sum(lengths[:fit]) / (fit * MAX_TOKENS)


def run_capacity_bench(budget_tokens: int, block_sizes: list[int], seed: int = 0) -> dict:
    lengths = length_mix(20_000, seed)
    contiguous, contiguous_unused = contiguous_fit(lengths, budget_tokens)
    rows = []
    for bs in block_sizes:
        paged, unused = paged_fit(lengths, budget_tokens, bs)
        rows.append(
            {
                "block_size": bs,
                "paged_seqs": paged,
                "contiguous_seqs": contiguous,
                "ratio": paged / contiguous,
                "paged_unused_share": unused,
                "contiguous_unused_share": contiguous_unused,
            }
        )
    return {
        "budget_tokens": budget_tokens,
        "mean_length": sum(lengths) / len(lengths),
        "median_length": sorted(lengths)[len(lengths) // 2],
        "rows": rows,
    }
