"""The step thread and torch's OpenMP workers bound one to a core; every other thread free to run anywhere.

Real threads, real libgomp teams, the kernel's own affinity masks (and a real daemon's threads, read from /proc).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from daemon_fixtures import start_daemon

from kvtierd.kernels.thread_pinning import (TEAM_START_ELEMENTS, NotPinned, PinnedThreads, one_cpu_per_core,
                                            pin_compute_threads)
from kvtierd.tiers.background_work import init_worker_thread

CORES = one_cpu_per_core(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to bind apart")


def _on_a_new_thread(fn, threads: int = 2):
    """`fn()`'s dict, run on a new thread computing with `threads` of torch's; torch's count is set back after
    (a new thread starts from the last count set anywhere)."""
    out, default = {}, torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            out.update(fn())
        finally:
            torch.set_num_threads(default)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


@needs_two_cores
def test_the_step_thread_and_its_worker_get_a_core_each_and_keep_them():
    everyone = os.sched_getaffinity(0)

    def step_thread() -> dict:
        pinned = pin_compute_threads()
        bound = {tid: os.sched_getaffinity(tid) for tid in pinned.worker_ids}
        # a step at one thread fewer, then at every thread again: the same team, still bound, no new thread
        threads = set(os.listdir("/proc/self/task"))
        torch.set_num_threads(1)
        torch.ones(TEAM_START_ELEMENTS).add_(1)
        torch.set_num_threads(2)
        torch.ones(TEAM_START_ELEMENTS).add_(1)
        return {"pinned": pinned, "mine": os.sched_getaffinity(0), "bound": bound,
                "after": {tid: os.sched_getaffinity(tid) for tid in pinned.worker_ids},
                "new": set(os.listdir("/proc/self/task")) - threads}

    out = _on_a_new_thread(step_thread)
    pinned = out["pinned"]
    assert (pinned.step_cpu, pinned.worker_cpus) == (CORES[0], (CORES[1],))
    assert out["mine"] == {CORES[0]}
    assert out["bound"] == {pinned.worker_ids[0]: {CORES[1]}}
    assert out["after"] == out["bound"] and not out["new"]
    assert os.sched_getaffinity(0) == everyone  # the thread that started it is not bound


@needs_two_cores
def test_a_tier_worker_started_by_the_bound_step_thread_runs_on_every_core():
    def step_thread() -> dict:
        assert isinstance(pin_compute_threads(), PinnedThreads)
        with ThreadPoolExecutor(1, initializer=init_worker_thread) as tiers, ThreadPoolExecutor(1) as plain:
            return {"tiers": tiers.submit(os.sched_getaffinity, 0).result(),
                    "plain": plain.submit(os.sched_getaffinity, 0).result()}

    out = _on_a_new_thread(step_thread)
    assert out["plain"] == {CORES[0]}  # what a thread inherits from its creator, hence the initializer
    assert out["tiers"] == os.sched_getaffinity(os.getpid())


@needs_two_cores
def test_nothing_is_bound_for_a_thread_whose_team_had_started():
    def step_thread() -> dict:
        torch.ones(TEAM_START_ELEMENTS).add_(1)  # its workers cannot be told apart from other threads any more
        return {"pinned": pin_compute_threads(), "mine": os.sched_getaffinity(0)}

    out = _on_a_new_thread(step_thread)
    assert out["pinned"] == NotPinned("0 new threads beside the step thread, not torch's 1 workers")
    assert out["mine"] == os.sched_getaffinity(os.getpid())


def test_nothing_is_bound_for_a_step_thread_that_computes_alone():
    def step_thread() -> dict:
        return {"pinned": pin_compute_threads(), "mine": os.sched_getaffinity(0)}

    out = _on_a_new_thread(step_thread, threads=1)
    assert out["pinned"] == NotPinned("torch computes on one thread")
    assert out["mine"] == os.sched_getaffinity(os.getpid())


def test_smt_siblings_count_as_one_core(tmp_path):
    # Two cores of two threads each, numbered the way Linux numbers siblings (cpu0 and cpu2 share core 0).
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert one_cpu_per_core({0, 1, 2, 3}, tmp_path) == [0, 1]
    assert one_cpu_per_core({2, 3}, tmp_path) == [2, 3]
    assert one_cpu_per_core({0, 2}, tmp_path) == [0]


def _affinities(pid: int) -> list[str]:
    masks = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        masks.append(next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")))
    return masks


@needs_two_cores
@pytest.mark.parametrize("pin", ["true", "false"])
def test_a_daemon_binds_its_compute_threads_unless_told_not_to(tmp_path, pin):
    daemon = start_daemon(tmp_path, env={"KVTIERD_PIN_COMPUTE_THREADS": pin, "KVTIERD_DEVICE": "cpu"})
    try:
        with daemon.client() as client:  # a request: the tiers' and the server's threads are started
            reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 2})
            assert reply.status_code == 200
        masks = _affinities(daemon.process.pid)
    finally:
        daemon.stop()
    single = [m for m in masks if m.isdigit()]  # bound to one CPU
    if pin == "true":
        assert len(single) >= 2 and len(set(single)) == len(single)  # the step thread and its workers, apart
        assert len(single) < len(masks)  # and no other thread
        assert "compute threads pinned: the step thread to CPU" in daemon.log_text()
    else:
        assert single == [] and "compute threads" not in daemon.log_text()
