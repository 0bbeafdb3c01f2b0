"""Paced loads: uncounted (a step keeps every thread), one at a time while an engine computes for running
requests, sleeping between slices of their work, and at full speed, side by side, for an engine that computes
nothing else. Events, not clocks: what is checked is which task runs when, never how long anything took."""

import threading
import time

from kvtierd.tiers import background_work
from kvtierd.tiers.background_work import BACKGROUND_WORK, BackgroundWork
from kvtierd.tiers.chunk import ChunkSpan, FoundChunk
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.transfer import TransferQueue, TransferStats


def burn_cpu(seconds: float) -> None:
    """Uses this thread's CPU for `seconds` (thread time: the same on a slow machine as on a fast one)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def wait_until(condition, limit_s: float = 30.0) -> None:
    """Polls `condition` until it holds; fails only if it never does within a generous bound."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.001)


def test_paced_tasks_do_not_count_so_a_step_keeps_every_thread():
    work = BackgroundWork()
    pool = work.pool(2, "test-paced", paced=True)
    release = threading.Event()
    try:
        task = pool.submit(release.wait)
        assert not work.busy
        release.set()
        assert task.result(timeout=30)
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_paced_tasks_run_one_at_a_time_while_an_engine_computes_and_side_by_side_when_none_does():
    work = BackgroundWork()
    pool = work.pool(2, "test-paced", paced=True)
    events: list[str] = []
    first_in, second_in, go = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        events.append("first starts")
        first_in.set()
        go.wait(30)
        events.append("first ends")

    def second() -> None:
        second_in.set()
        events.append("second starts")

    try:
        work.engine_computes(True)
        a = pool.submit(first)
        assert first_in.wait(30)
        b = pool.submit(second)
        assert not second_in.wait(0.2)  # a free worker, but the first task has the turn
        go.set()
        a.result(timeout=30)
        b.result(timeout=30)
        assert events == ["first starts", "first ends", "second starts"]

        work.engine_computes(False)  # nothing running: loads for a lone request go at once, side by side
        both_in = threading.Barrier(2, timeout=30)
        tasks = [pool.submit(both_in.wait) for _ in range(2)]
        for t in tasks:
            t.result(timeout=30)  # a BrokenBarrierError here: they ran one at a time
    finally:
        go.set()
        pool.shutdown(wait=True)


def test_a_paced_task_sleeps_between_slices_until_the_engine_stops_computing():
    """A slice of CPU time, then `pace`: it waits (its share of a core is spent) while the engine computes, and
    goes on as soon as the engine has nothing running."""
    work = BackgroundWork()
    pool = work.pool(1, "test-paced", paced=True)
    sliced, paced = threading.Event(), threading.Event()

    def load() -> None:
        burn_cpu(0.5)  # its sleep would be longer than the test waits below
        sliced.set()
        work.pace()
        paced.set()

    try:
        work.engine_computes(True)
        task = pool.submit(load)
        assert sliced.wait(60)
        assert not paced.wait(0.2)  # yielding to the steps
        work.engine_computes(False)
        task.result(timeout=30)
        assert paced.is_set()
    finally:
        pool.shutdown(wait=True)


def test_pace_does_nothing_outside_a_paced_task():
    """The step thread (or a tool) copying pages through the same code never waits."""
    work = BackgroundWork()
    work.engine_computes(True)

    def copy_on_a_plain_thread() -> None:
        burn_cpu(0.5)
        work.pace()

    thread = threading.Thread(target=copy_on_a_plain_thread)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive()  # it did not wait for the engine to stop computing
    finally:
        work.engine_computes(False)
        thread.join()


def test_a_paced_task_stops_yielding_at_its_bound(monkeypatch):
    """Past its `pace_until` (a share of its request's deadline), a load goes at full speed."""
    monkeypatch.setattr(background_work, "PACED_SHARE", 1e-9)  # a slice's sleep would outlast the test
    work = BackgroundWork()
    pool = work.pool(1, "test-paced", paced=True)

    def load() -> None:
        work.pace_until(time.monotonic() - 1.0)  # already past
        burn_cpu(0.1)
        work.pace()

    try:
        work.engine_computes(True)
        pool.submit(load).result(timeout=60)  # the engine still computes: it did not wait for it to stop
    finally:
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_paced_task_works_in_slices_only_while_it_would_yield():
    """`pacing` tells a load to copy layer by layer (pacing between) or in one piece: only a paced task, while an
    engine computes and before its bound, goes in slices."""
    work = BackgroundWork()
    pool = work.pool(1, "test-paced", paced=True)

    def seen(until: float | None) -> bool:
        work.pace_until(until)
        return work.pacing()

    try:
        assert not pool.submit(seen, None).result(timeout=60)  # no engine computes: in one piece
        work.engine_computes(True)
        assert pool.submit(seen, None).result(timeout=60)
        assert pool.submit(seen, time.monotonic() + 3600).result(timeout=60)
        assert not pool.submit(seen, time.monotonic() - 1.0).result(timeout=60)  # past its bound
        assert not work.pacing()  # not a paced task's thread
    finally:
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_load_whose_tier_cannot_yield_counts_and_does_not_pace(monkeypatch):
    """A fleet value's load (its GET, HMAC and decode in one piece) takes the core the steps leave to counted
    work, instead of sleeping after it: through the transfer queue, as the tier manager submits it."""
    monkeypatch.setattr(background_work, "PACED_SHARE", 1e-9)  # were it paced, it would sleep past the test
    seen: list[bool] = []

    def load(found, skip, block_ids):
        seen.append(BACKGROUND_WORK.busy)
        burn_cpu(0.1)
        BACKGROUND_WORK.pace()
        return Tier.REMOTE

    queue = TransferQueue(load, 1, TransferStats(), yields=lambda found: found.tier is not Tier.REMOTE)
    BACKGROUND_WORK.engine_computes(True)
    try:
        chunk = FoundChunk(Tier.REMOTE, ChunkSpan(b"ns", 0, (b"h",), (1,)))
        done = queue.submit("r1", chunk, 0, [0], False, pace_until=None)
        assert done.future.result(timeout=60) is Tier.REMOTE
        assert seen == [True]
        wait_until(lambda: not BACKGROUND_WORK.busy)
    finally:
        BACKGROUND_WORK.engine_computes(False)
        queue.close()


def test_a_task_counted_until_done_counts_from_its_submission_while_it_waits_its_turn():
    """A fleet load waiting for its turn behind another already counts: no step starts at every thread just
    before its burst."""
    work = BackgroundWork()
    pool = work.pool(1, "test-paced", paced=True)
    release = threading.Event()
    try:
        work.engine_computes(True)
        first = pool.submit(release.wait, 30)
        assert not work.busy  # a paced task that yields does not count
        queued = pool.submit(lambda: None)
        work.count_until_done(queued)
        assert work.busy and work.awaited  # queued behind the first, not started, and counted already
        release.set()
        first.result(timeout=30)
        queued.result(timeout=30)
        wait_until(lambda: not work.busy)  # its count ends in a done-callback, which may run after result()
    finally:
        release.set()
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_store_waiting_on_its_store_stops_counting_after_a_while_until_the_wait_ends():
    """A store's write held by a slow Redis: the steps get every thread back while it waits, and leave it one
    again once it computes. Waits outside a counted store's task change nothing."""
    work = BackgroundWork()
    pool = work.pool(1, "test-counted")
    in_wait, end_wait, end_task = threading.Event(), threading.Event(), threading.Event()

    def task():
        with work.waiting():
            in_wait.set()
            end_wait.wait(30)
        end_task.wait(30)

    try:
        with work.waiting():  # not a counted task's thread
            assert not work.busy
        done = pool.submit(task)
        assert work.busy and not work.awaited  # a store: no request waits for it
        assert in_wait.wait(30)
        wait_until(lambda: not work.busy)  # it has waited COUNTED_WAIT_S
        end_wait.set()
        wait_until(lambda: work.busy)  # computing again
        end_task.set()
        done.result(timeout=30)
        wait_until(lambda: not work.busy)
    finally:
        end_wait.set()
        end_task.set()
        pool.shutdown(wait=True)
