"""A chunk being stored, as its tiers take it from the device pages: the host slab gathers the pages straight
into its slot (`fill`); the writers of disk and fleet share one CPU copy (`copy`), made the first time one
asks, now on this thread or, given a copier, on the store-copy thread (its future goes to `copied`, and the
caller keeps the pages referenced until it is done)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future

import torch

from kvtierd.tiers.page_copy import PageCopier


class DeviceChunk:
    def __init__(self, pages: PageCopier, block_ids: Sequence[int], copier: Executor | None = None,
                 copied: list[Future] | None = None) -> None:
        self.block_ids = tuple(block_ids)
        self._pages = pages
        self._copier = copier if copied is not None else None
        self._copied = copied
        self._copy: torch.Tensor | Future | None = None

    def fill(self, out: torch.Tensor) -> None:
        """Copies the pages into `out` (CPU, chunk layout)."""
        self._pages.gather_into(out, self.block_ids)

    def copy(self) -> torch.Tensor | Future:
        """The pages copied to CPU memory (a tensor in chunk layout), or the future of that copy."""
        if self._copy is None:
            if self._copier is None:
                self._copy = self._pages.gather(self.block_ids)
            else:  # the writers take the copy when it is made: stored -> copying -> queued to write
                self._copy = self._copier.submit(self._pages.gather, self.block_ids)
                self._copied.append(self._copy)
        return self._copy
