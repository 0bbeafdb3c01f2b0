"""The step thread and torch's OpenMP workers bound one to a core (the CPU backend).

A step's parallel regions wait for their slowest thread, so two compute threads
sharing a core while another core idles make the whole step take twice as
long. Left to the kernel, that happens after a pause: while the step thread
waits (a lend to the tiers' loads), its worker spins on one core and the other
core runs the load; when the step thread wakes, no core is idle, so it is
queued on the spinner's core and the two share it, the freed core idle, until
the scheduler balances them. A sched_switch trace of `bench stall`'s remote
scenario (2 cores) showed exactly that in its slow forwards: 22-26 ms instead
of 11, the compute threads taking turns on one core for up to 16 ms. Bound one to a core, they cannot
meet: of the forwards run while a load ran, 3.4-5.5% took over 18 ms unbound
and 0-0.6% bound (a step-log probe over three and four runs of the disk and
remote scenarios; their p99 23.4-24.6 ms against 14.4-17.1).

libgomp keeps one team of workers per thread that starts a parallel region,
creates it at that thread's first region and keeps it (a narrower region uses
part of it), and its threads inherit their creator's affinity. So the team is
started here, on the step thread before it first computes, and told apart as
the threads that appeared meanwhile; each is then bound to a core of its own.
Threads the daemon starts elsewhere keep every core; the tiers' workers, which
the step thread starts, widen theirs back as they start
(tiers/background_work.py: `init_worker_thread`).

The trade: a bound thread cannot move off a core another thread takes for a
while, so a long prefill beside other busy threads loses more (5-10% against 2-3%
unbound in `bench stall`'s slow and stopped Redis scenarios); `[engine]
pin_compute_threads = false` for a host that runs other CPU work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# Elements of the add that starts the team: above torch's grain size (32,768), so it runs as a parallel region.
TEAM_START_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class PinnedThreads:
    step_cpu: int
    worker_cpus: tuple[int, ...]  # in the order of `worker_ids`
    worker_ids: tuple[int, ...]  # the workers' native thread ids

    def __str__(self) -> str:
        return (f"pinned: the step thread to CPU {self.step_cpu}, torch's workers to CPUs "
                f"{', '.join(map(str, self.worker_cpus))}")


@dataclass(frozen=True, slots=True)
class NotPinned:
    reason: str

    def __str__(self) -> str:
        return f"not pinned: {self.reason}"


def one_cpu_per_core(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """Of `cpus`, the lowest of each physical core's (SMT siblings share a core's units), in order."""
    cores: dict[tuple[str, str], int] = {}
    for cpu in sorted(cpus):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            core = (topology.joinpath("physical_package_id").read_text(), topology.joinpath("core_id").read_text())
        except OSError:
            core = (str(cpu), "")  # no topology: each CPU its own core
        cores.setdefault(core, cpu)
    return sorted(cores.values())


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def pin_compute_threads() -> PinnedThreads | NotPinned:
    """On the thread that will compute the steps, before it first runs a torch op: starts its OpenMP team and
    binds it and its workers one to a core. Nothing is bound when torch computes on one thread, when there are
    fewer cores than threads, when the thread's team cannot be told apart (it had started already, or another
    thread started beside it), or when the system refuses. The daemon logs the outcome once its model has
    loaded (a start that fails says one line: its error)."""
    threads = torch.get_num_threads()
    if threads < 2:
        return NotPinned("torch computes on one thread")
    cores = one_cpu_per_core(os.sched_getaffinity(0))
    if len(cores) < threads:
        return NotPinned(f"{threads} threads on {len(cores)} cores")
    before = _thread_ids()
    torch.ones(TEAM_START_ELEMENTS).add_(1)
    workers = sorted(_thread_ids() - before)
    if len(workers) != threads - 1:
        return NotPinned(f"{len(workers)} new threads beside the step thread, not torch's {threads - 1} workers")
    pinned = PinnedThreads(cores[0], tuple(cores[1:threads]), tuple(workers))
    try:
        for thread, cpu in zip((*pinned.worker_ids, 0), (*pinned.worker_cpus, pinned.step_cpu), strict=True):
            os.sched_setaffinity(thread, {cpu})
    except OSError as e:  # a sandbox that refuses it (systemd's @system-service allows it)
        return NotPinned(f"refused ({e}); some workers may be bound")
    return pinned
