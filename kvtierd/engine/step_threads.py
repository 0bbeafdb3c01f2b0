"""How many threads a step computes with: all of torch's, or one fewer while the KV tiers work.

A step's matrix products and attention run on torch's intra-op threads, one
per core, and each parallel region waits for its slowest thread. The tiers'
workers (loads, stores, prefetches: tiers/background_work.py) run on threads
of their own. When both want every core, a step's thread that loses its core
for a time slice stalls the whole region: in a probe on 2 cores, a zstd +
hash worker beside three decoding streams raised the steps' p95 several-fold
at 2 threads, while at 1 thread it stayed near its own pace. So while
background work is pending, a step leaves it one core; steps go back to every
thread when it is done. The lower tiers' writes mostly wait for the engine's
idle spells instead (tiers/background_work.py); waiting, they are not pending,
so only one that runs (past its deferral bound, or started in an idle spell a
request then ended) takes the step's core. Loads are not counted: they
are paced (in slices, within the time the engine lends them between its
steps), and a step keeps every thread.

A long step (LONG_STEP_S, as the step-cost fit predicts it) keeps every
thread beside stores all the same: a store's burst (a chunk's encode) costs
it about its own few ms at every thread, and half the step's length at one.
With a store's encode pending as it started, a 2,048-token prefill ran at one
thread for 2.4 s instead of 1.2, and the streams beside it waited all that
time (`bench stall`, slow Redis). Work a request waits for (a prefetch's
copy: `awaited`) gets its core whatever the step: beside a long step at
every thread, the first fleet load after a start (counted then) took long
enough that the restore planner chose recomputing for every load after it.

OpenMP keeps the thread count per calling thread: `before_step` is called on
the thread that runs the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtierd.kernels.torch_threads import COMPUTE_THREADS

# A step predicted to take at least this long keeps every thread beside stores: a prefill chunk of some hundred
# tokens on a small CPU, against 10-30 ms for a step of decodes.
LONG_STEP_S = 0.1


class StepThreads:
    def __init__(self, busy: Callable[[], bool], awaited: Callable[[], bool] = lambda: False,
                 num_threads: int | None = None) -> None:
        """`busy`: background work is pending; `awaited`: of it, work a request waits for."""
        self.num_threads = num_threads or COMPUTE_THREADS
        self._busy, self._awaited = busy, awaited

    def before_step(self, predicted_s: Callable[[], float] = lambda: 0.0) -> int:
        """Sets and returns the thread count for the step about to run; `predicted_s()`, what it will take, is
        asked only when stores alone are pending (a prediction refits the step-cost model)."""
        leave_one = self.num_threads > 1 and (self._awaited() or self._busy() and predicted_s() < LONG_STEP_S)
        n = self.num_threads - 1 if leave_one else self.num_threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
