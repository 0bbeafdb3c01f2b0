"""How many threads a step computes with: all of torch's, or one fewer while the KV tiers work.

A step's matrix products and attention run on torch's intra-op threads, one
per core, and each parallel region waits for its slowest thread. The tiers'
workers (loads, stores, prefetches: tiers/background_work.py) run on threads
of their own. When both want every core, a step's thread that loses its core
for a time slice stalls the whole region: measured on 2 cores (int4, three
streams decoding, a zstd + hash worker beside them), 2 threads took 104 ms a
step at the median and 340 ms at p95, against 63 and 73 ms with 1 thread,
and 43 and 51 ms with 2 threads and nothing beside them. So while background
work is pending, a step leaves it one core; steps go back to every thread
when it is done.

OpenMP keeps the thread count per calling thread: `before_step` is called on
the thread that runs the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepThreads:
    def __init__(self, busy: Callable[[], bool], num_threads: int | None = None) -> None:
        self.num_threads = num_threads or torch.get_num_threads()
        self._busy = busy

    def before_step(self) -> int:
        """Sets and returns the thread count for the step about to run."""
        n = self.num_threads - 1 if self.num_threads > 1 and self._busy() else self.num_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
