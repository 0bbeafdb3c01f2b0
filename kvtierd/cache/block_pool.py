"""Fixed-size KV pages with reference counts and a free queue.

Running out of pages is a normal outcome (`allocate` returns None and the
caller waits or preempts); a broken count is a bug and asserts.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one page; raise the KV budget")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Takes `n` free pages with ref count 1, or None if there are fewer free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            assert self._ref_counts[b] == 0, f"free page {b} still referenced"
            self._ref_counts[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"sharing unowned page {b}"
            self._ref_counts[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each page; pages reaching zero become free."""
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"releasing unowned page {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
