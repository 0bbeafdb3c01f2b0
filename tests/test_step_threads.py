"""A step leaves the tiers' background work a core while it is pending, and takes every thread back after."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtierd.engine.step_threads import LONG_STEP_S, StepThreads
from kvtierd.kernels.torch_threads import COMPUTE_THREADS
from kvtierd.tiers.background_work import BackgroundWork


def test_background_work_counts_each_task_from_submission_to_its_end():
    work = BackgroundWork()
    pool = work.pool(1, "test-bg")
    release = threading.Event()
    try:
        assert not work.busy
        running = pool.submit(release.wait)
        queued = pool.submit(lambda: None)  # behind the first: pending, not running
        cancelled = pool.submit(lambda: None)
        assert cancelled.cancel()
        assert work.busy
        release.set()
        running.result()
        queued.result()
        assert not work.busy
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_counted_work_counts_while_it_runs():
    work = BackgroundWork()
    with work.counted():
        assert work.busy
    assert not work.busy


def test_a_step_leaves_one_thread_to_pending_background_work():
    before = torch.get_num_threads()
    pending, awaited = [False], [False]
    threads = StepThreads(lambda: pending[0], lambda: awaited[0], num_threads=4)
    try:
        assert threads.before_step() == 4 and torch.get_num_threads() == 4
        pending[0] = True
        assert threads.before_step() == 3 and torch.get_num_threads() == 3
        # A long step (a prefill chunk) keeps every thread beside stores: a burst costs it less than a thread...
        assert threads.before_step(lambda: LONG_STEP_S) == 4 and torch.get_num_threads() == 4
        assert threads.before_step(lambda: LONG_STEP_S / 2) == 3
        awaited[0] = True  # ... but not beside work a request waits for (a fleet load)
        assert threads.before_step(lambda: LONG_STEP_S) == 3
        pending[0] = awaited[0] = False
        assert threads.before_step() == 4 and torch.get_num_threads() == 4
        assert threads.before_step(lambda: 1 / 0) == 4  # nothing pending: no prediction asked (it refits)
        assert StepThreads(lambda: True, lambda: True, num_threads=1).before_step() == 1  # never below one
    finally:
        torch.set_num_threads(before)


def test_tier_workers_compute_alone_and_the_step_keeps_every_thread():
    """One thread computes with torch's threads (kernels/torch_threads.py): a tier worker's torch ops run on
    the worker alone, and a step after it still gets every thread, though a new thread would start from the
    worker's count."""
    work = BackgroundWork()
    pools = [work.pool(1, "test-counted"), work.pool(1, "test-deferred", defer_s=0.01)]
    try:
        assert [p.submit(torch.get_num_threads).result() for p in pools] == [1, 1]
        step = ThreadPoolExecutor(1, "test-step")
        steps = StepThreads(lambda: False)
        assert step.submit(steps.before_step).result() == COMPUTE_THREADS
        assert step.submit(torch.get_num_threads).result() == COMPUTE_THREADS
        step.shutdown(wait=True)
    finally:
        for p in pools:
            p.shutdown(wait=True)
