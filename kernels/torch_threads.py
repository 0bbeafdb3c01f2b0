"""Which threads compute with torch's intra-op threads: one.

torch's CPU wheel parallelises with libgomp, which keeps a team of worker threads for each thread that starts
a parallel region, and lets the workers spin between regions only while it manages no more threads than there
are cores; past that they sleep, and every region pays their wake-up. A decode step is a few hundred short
regions: on 2 cores (Zen 5), the int4 matrices of a decode step took 4.4 ms from the one thread that had
computed, and 12 ms from a second one (the daemon's step thread, the model having been loaded on another), a
daemon's decode ~2.5x slower than the engine's. So the daemon loads its model and runs every step on one
thread (`step_executor`), and the other threads that may run torch ops (the tiers' workers) run them on
themselves alone (`tiers/background_work.py`: `init_worker_thread`, their pools' initializer). On the
CPU backend the step thread and its team are also bound one to a core (`thread_pinning.py`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

# torch's count before any worker narrowed its own (a new thread starts from the last count set anywhere)
COMPUTE_THREADS = torch.get_num_threads()


def step_executor() -> ThreadPoolExecutor:
    """The thread that loads the model and runs the steps."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtierd-step")
