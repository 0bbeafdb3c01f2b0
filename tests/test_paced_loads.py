"""Paced loads: uncounted (a step keeps every thread); while an engine computes for running requests, they run
one at a time and only within the time the engine lends them between its steps; for an engine that computes
nothing else, at full speed, side by side. Events, not clocks: what is checked is which task runs when, never
how long anything took."""

import threading
import time

import pytest

from kvtierd.tiers.background_work import BackgroundWork, TaskAbandoned


def wait_until(condition, limit_s: float = 30.0) -> None:
    """Polls `condition` until it holds; fails only if it never does within a generous bound."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.001)


class Lender:
    """An engine's step loop as paced tasks see it: lends them time between its (empty) steps until stopped."""

    def __init__(self, work: BackgroundWork) -> None:
        self._work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._work.lend(0.01)
            time.sleep(0.001)  # the step itself

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_paced_tasks_do_not_count_so_a_step_keeps_every_thread():
    work = BackgroundWork()
    pool = work.paced_pool(2, "test-paced")
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
    pool = work.paced_pool(2, "test-paced")
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

    work.engine_computes(True)
    lender = Lender(work)
    try:
        a = pool.submit(first)
        assert first_in.wait(30)
        b = pool.submit(second)
        assert not second_in.wait(0.2)  # a free worker, but the first task has the turn
        go.set()
        a.result(timeout=30)
        b.result(timeout=30)
        assert events == ["first starts", "first ends", "second starts"]
    finally:
        go.set()
        lender.stop()
        work.engine_computes(False)
    try:
        both_in = threading.Barrier(2, timeout=30)  # nothing running: loads for a lone request go at once
        tasks = [pool.submit(both_in.wait) for _ in range(2)]
        for t in tasks:
            t.result(timeout=30)  # a BrokenBarrierError here: they ran one at a time
    finally:
        pool.shutdown(wait=True)


def test_while_an_engine_computes_a_paced_task_works_only_within_its_lends():
    """No slice starts before the engine lends time; one lend long enough runs the task to its end and returns
    as soon as nothing is left to run."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    events: list[str] = []
    started = threading.Event()

    def load() -> None:
        events.append("slice 1")
        started.set()
        work.pace()
        events.append("slice 2")

    work.engine_computes(True)
    try:
        task = pool.submit(load)
        assert not started.wait(0.2)  # no lend: it waits between steps that never come
        work.lend(3600)  # returns once the task has ended, not an hour later
        task.result(timeout=30)
        assert events == ["slice 1", "slice 2"]
        work.lend(3600)  # nothing to run: returns at once
    finally:
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_lend_ends_at_its_time_and_waits_so_long_for_a_slice_that_runs_on():
    """The step waits for a slice running as its lend ends at most SLICE_WAIT_S; the task's next slice then waits
    for another lend, and starts at once when the engine stops computing."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    in_slice, go, second = threading.Event(), threading.Event(), threading.Event()

    def load() -> None:
        in_slice.set()
        go.wait(60)
        work.pace()
        second.set()

    work.engine_computes(True)
    computing = True
    try:
        task = pool.submit(load)
        lend = threading.Thread(target=work.lend, args=(1.0,))
        lend.start()
        assert in_slice.wait(30)
        lend.join(30)
        assert not lend.is_alive() and not go.is_set()  # the lend returned with the slice still running
        go.set()
        assert not second.wait(0.2)  # its next slice waits for a lend
        work.engine_computes(False)
        computing = False
        task.result(timeout=30)
        assert second.is_set()
    finally:
        go.set()
        if computing:
            work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_wait_that_takes_no_core_goes_on_between_lends_and_the_work_after_it_waits_for_one():
    """A direct read from disk (`unsliced`) is no slice: it runs with no lend open and a lend does not wait for
    it; what the task does after it waits for the next lend."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    events: list[str] = []
    in_read, read_done, after = threading.Event(), threading.Event(), threading.Event()

    def load() -> None:
        events.append("slice 1")
        with work.unsliced():
            in_read.set()
            assert read_done.wait(30)
        events.append("slice 2")
        after.set()

    work.engine_computes(True)
    try:
        task = pool.submit(load)
        lend = threading.Thread(target=work.lend, args=(3600,))
        lend.start()
        assert in_read.wait(30)
        lend.join(30)  # it ran slice 1 and returned once the task was in its read, not an hour later
        assert not lend.is_alive() and events == ["slice 1"]
        read_done.set()  # the read ends between lends
        assert not after.wait(0.2)  # the work after it waits for a lend
        work.lend(3600)
        task.result(timeout=30)
        assert events == ["slice 1", "slice 2"]
    finally:
        read_done.set()
        work.engine_computes(False)
        pool.shutdown(wait=True)
    with work.unsliced():  # the step thread (or a tool): nothing to end or wait for
        pass


def test_a_wait_that_takes_no_core_passes_the_turn_to_another_task():
    """While one task waits on a read (a Redis round trip), another runs its slices in the same lend: two loads
    wait on their reads side by side, not one after the other; the first takes the turn back after its read."""
    work = BackgroundWork()
    pool = work.paced_pool(2, "test-paced")
    events: list[str] = []
    in_read, read_done = threading.Event(), threading.Event()

    def waits_on_a_read() -> None:
        events.append("first: before its read")
        with work.unsliced():
            in_read.set()
            assert read_done.wait(30)
        events.append("first: after its read")

    work.engine_computes(True)
    try:
        first = pool.submit(waits_on_a_read)
        wait_until(first.running)  # it has the turn
        second = pool.submit(lambda: events.append("second"))
        lend = threading.Thread(target=work.lend, args=(3600,))
        lend.start()
        assert in_read.wait(30)
        second.result(timeout=30)  # it ran while the first waited on its read
        lend.join(30)  # and the lend returned once nothing was left to run, not an hour later
        assert not lend.is_alive() and events == ["first: before its read", "second"]
        read_done.set()
        wait_until(lambda: work.wants_lend)  # its work after the read asks for a lend
        work.lend(3600)
        first.result(timeout=30)
        assert events[-1] == "first: after its read"
    finally:
        read_done.set()
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_pace_does_nothing_outside_a_paced_task():
    """The step thread (or a tool) copying pages through the same code never waits."""
    work = BackgroundWork()
    work.engine_computes(True)
    thread = threading.Thread(target=work.pace)
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive()  # it did not wait for a lend
        assert not work.pacing()  # nor would it work in slices
    finally:
        work.engine_computes(False)


def test_a_paced_task_past_its_bound_runs_without_a_lend():
    """Past its bound (a share of its request's deadline), a load goes at full speed, in one piece."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")

    def load() -> bool:
        work.pace()
        return work.pacing()

    work.engine_computes(True)
    try:
        assert pool.submit_paced(time.monotonic() - 1.0, load).result(timeout=60) is False  # no lend given
    finally:
        work.engine_computes(False)
        pool.shutdown(wait=True)


def abandoned_at_its_third_slice(work: BackgroundWork, unwanted: threading.Event, slices: list[int]):
    """A load of five slices whose requests all leave while its third runs."""

    def load() -> None:
        for i in range(5):
            slices.append(i)
            if i == 2:
                unwanted.set()
            work.pace()

    return load


def test_a_paced_task_nobody_wants_any_more_stops_where_its_next_slice_would_start():
    """A load whose requests all left (cancelled, or past their deadline) stops at its next `pace`; a task
    given no test runs to its end."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    unwanted = threading.Event()
    slices: list[int] = []
    load = abandoned_at_its_third_slice(work, unwanted, slices)
    try:
        with pytest.raises(TaskAbandoned):
            pool.submit_paced(None, load, unwanted=unwanted.is_set).result(timeout=60)
        assert slices == [0, 1, 2]
        slices.clear()
        pool.submit_paced(None, load).result(timeout=60)
        assert slices == [0, 1, 2, 3, 4]
    finally:
        pool.shutdown(wait=True)


def test_a_paced_task_abandoned_while_it_waits_for_its_first_lend_never_starts():
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    unwanted = threading.Event()
    slices: list[int] = []
    work.engine_computes(True)  # it waits for a lend to start
    try:
        waiting = pool.submit_paced(None, abandoned_at_its_third_slice(work, unwanted, slices),
                                    unwanted=unwanted.is_set)
        unwanted.set()
        work.lend(60.0)  # returns once no paced task is left to run in it
        with pytest.raises(TaskAbandoned):
            waiting.result(timeout=60)
        assert slices == []
    finally:
        work.engine_computes(False)
        pool.shutdown(wait=True)


def test_a_paced_task_works_in_slices_only_while_it_would_yield():
    """`pacing` tells a load to copy layer by layer (pacing between) or in one piece: only a paced task, while an
    engine computes and before its bound, goes in slices."""
    work = BackgroundWork()
    pool = work.paced_pool(1, "test-paced")
    lender = None
    try:
        assert not pool.submit(work.pacing).result(timeout=60)  # no engine computes: in one piece
        work.engine_computes(True)
        lender = Lender(work)
        assert pool.submit(work.pacing).result(timeout=60)
        assert pool.submit_paced(time.monotonic() + 3600, work.pacing).result(timeout=60)
        assert not pool.submit_paced(time.monotonic() - 1.0, work.pacing).result(timeout=60)  # past its bound
    finally:
        if lender is not None:
            lender.stop()
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
