"""`kvtierd bench capacity`: a KV budget under a stream of requests, three ways to hand it out.

A simulation in decode steps, the same seeded requests for every allocator:
requests arrive (Poisson; a long-tailed mix of prompt and output lengths), wait
in a FIFO queue, are admitted when the allocator places their prompt, grow by
one token a step while they decode, and free their KV when done.

- paged: the real KVCacheManager, pages of `block_size` tokens taken as a
  sequence grows. When a running sequence needs a page and none is free, the
  most recently admitted one is preempted (its pages freed, back to the head of
  the queue, its tokens recomputed on readmission), as vLLM does.
- full window: a slot of the whole context window per sequence, reserved at
  admission (llama.cpp's slots, transformers' static cache): budget / window slots.
- exact size, first fit: each sequence reserves one contiguous range of exactly
  its final length (prompt + output: an oracle a real server does not have),
  placed first fit in the budget's address space. No slot is wasted inside a
  range; the cost is external fragmentation: a queue head that waits although
  enough slots are free, in pieces too small.

Measured every step: requests running, tokens held, slots reserved but holding
no token (wasted), and for first fit the free slots no waiting request could use.
"""

from __future__ import annotations

import math
import random
import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvtierd.cache.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class CapacityWorkload:
    budget_tokens: int = 65_536  # KV token slots
    window: int = 4096  # the context window: the longest prompt + output
    block_size: int = 16
    arrivals_per_step: float = 0.5  # more than any allocator here serves: the queue never runs dry
    steps: int = 3000
    warmup_steps: int = 500  # not measured: the budget fills up first
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.budget_tokens, self.window, self.block_size, self.steps) < 1 or self.arrivals_per_step <= 0:
            raise ValueError("budget, window, block size and steps must be positive, and arrivals too")
        if self.window > self.budget_tokens:
            raise ValueError("the budget must hold at least one whole window")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError("warmup_steps must be in [0, steps)")


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: int  # step
    prompt: int
    output: int
    generated: int = 0
    admitted_at: int | None = None  # the latest admission
    first_admitted_at: int | None = None

    @property
    def length(self) -> int:  # tokens whose KV it holds while running
        return self.prompt + self.generated


@dataclass(frozen=True, slots=True)
class CapacityRow:
    allocator: str
    completed: int  # requests finished in the measured steps
    running_mean: float
    running_p50: float
    queue_wait_p50_steps: float  # arrival to first admission, of the requests admitted in the measured steps
    queue_wait_p95_steps: float
    held_share: float  # mean share of the budget holding a live token
    wasted_share: float  # mean share reserved or allocated but holding no token
    fragmented_share: float  # mean share free but in pieces too small for the queue head (first fit)
    preemptions: int
    recomputed_tokens: int  # KV computed again after a preemption
    fragmentation_stalls: int  # steps the queue head waited with enough free slots, in pieces too small


@dataclass(frozen=True, slots=True)
class CapacityFigures:
    workload: CapacityWorkload
    requests: int  # arrived in the whole run
    prompt_mean: float
    prompt_p50: int
    prompt_max: int
    output_mean: float
    output_p50: int
    output_max: int
    rows: list[CapacityRow]
    series: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # allocator -> (step, running, wasted)


def make_requests(w: CapacityWorkload) -> list[SimRequest]:
    """Poisson arrivals; prompts and outputs log-normal (most short, a few near the window)."""
    rng = random.Random(w.seed)
    out, t, rid = [], 0.0, 0
    while True:
        t += rng.expovariate(w.arrivals_per_step)
        if t >= w.steps:
            return out
        prompt = min(w.window - 8, max(16, int(rng.lognormvariate(6.0, 1.0))))
        output = min(w.window - prompt, max(8, int(rng.lognormvariate(5.0, 1.0))))
        out.append(SimRequest(rid, int(t), prompt, output))
        rid += 1


class Allocator(ABC):
    """Places sequences in the budget; `grow` is False when the sequence cannot take one more token."""

    name = ""

    @abstractmethod
    def admit(self, r: SimRequest) -> bool: ...

    @abstractmethod
    def grow(self, r: SimRequest) -> bool: ...

    @abstractmethod
    def free(self, r: SimRequest) -> None: ...

    @abstractmethod
    def reserved(self) -> int:
        """Token slots taken from the budget (holding a token or not)."""

    def unusable_free(self, head: SimRequest | None) -> int:
        return 0


class Paged(Allocator):
    def __init__(self, w: CapacityWorkload) -> None:
        self.name = f"paged {w.block_size}"
        self.block_size = w.block_size
        self.kv = KVCacheManager(w.budget_tokens // w.block_size, w.block_size)

    def admit(self, r: SimRequest) -> bool:
        return self.kv.allocate_slots(str(r.rid), r.length) is not None

    def grow(self, r: SimRequest) -> bool:
        return self.kv.allocate_slots(str(r.rid), 1) is not None

    def free(self, r: SimRequest) -> None:
        self.kv.free(str(r.rid))

    def reserved(self) -> int:
        return self.kv.pool.num_used_blocks * self.block_size


class FullWindow(Allocator):
    name = "full window"

    def __init__(self, w: CapacityWorkload) -> None:
        self.window = w.window
        self.free_slots = w.budget_tokens // w.window
        self.used = 0

    def admit(self, r: SimRequest) -> bool:
        if self.free_slots == 0:
            return False
        self.free_slots -= 1
        self.used += 1
        return True

    def grow(self, r: SimRequest) -> bool:
        return True  # the slot holds the whole window

    def free(self, r: SimRequest) -> None:
        self.free_slots += 1
        self.used -= 1

    def reserved(self) -> int:
        return self.used * self.window


class ExactFirstFit(Allocator):
    name = "first fit"

    def __init__(self, w: CapacityWorkload) -> None:
        self.holes: list[tuple[int, int]] = [(0, w.budget_tokens)]  # (start, size), by address
        self.ranges: dict[int, tuple[int, int]] = {}  # rid -> (start, size)

    def admit(self, r: SimRequest) -> bool:
        need = r.prompt + r.output
        for i, (start, size) in enumerate(self.holes):
            if size >= need:
                self.holes[i: i + 1] = [(start + need, size - need)] if size > need else []
                self.ranges[r.rid] = (start, need)
                return True
        return False

    def grow(self, r: SimRequest) -> bool:
        return True  # its range holds its final length

    def free(self, r: SimRequest) -> None:
        start, size = self.ranges.pop(r.rid)
        self.holes.append((start, size))
        self.holes.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.holes = merged

    def reserved(self) -> int:
        return sum(n for _, n in self.ranges.values())

    def unusable_free(self, head: SimRequest | None) -> int:
        """Free slots while the queue head finds no hole its size although that many are free."""
        free = sum(n for _, n in self.holes)
        if head is None or free < head.prompt + head.output or self.largest_hole() >= head.prompt + head.output:
            return 0
        return free

    def largest_hole(self) -> int:
        return max((n for _, n in self.holes), default=0)


def simulate(allocator: Allocator, requests: list[SimRequest], w: CapacityWorkload) -> tuple[CapacityRow, list]:
    arrivals = [SimRequest(r.rid, r.arrival, r.prompt, r.output) for r in requests]  # fresh state per allocator
    arrivals.reverse()  # pop() takes the next arrival
    queue: list[SimRequest] = []
    running: list[SimRequest] = []  # in admission order
    completed = preemptions = recomputed = stalls = 0
    running_counts, held, wasted, fragmented, waits, series = [], [], [], [], [], []
    for step in range(w.steps):
        measured = step >= w.warmup_steps
        while arrivals and arrivals[-1].arrival <= step:
            queue.append(arrivals.pop())
        # Decode: every running sequence grows by one token; one that cannot preempts the newest.
        i = 0
        while i < len(running):
            r = running[i]
            if allocator.grow(r):
                r.generated += 1
                i += 1
                continue
            victim = running.pop()  # the most recently admitted (it may be r itself)
            allocator.free(victim)
            queue.insert(0, victim)
            if measured:
                preemptions += 1
                recomputed += victim.length
        for r in [r for r in running if r.generated >= r.output]:
            running.remove(r)
            allocator.free(r)
            completed += measured
        # Admission: FIFO; the head waits until the allocator can place its prompt (and its growth so far).
        while queue and allocator.admit(queue[0]):
            r = queue.pop(0)
            r.admitted_at = step
            if r.first_admitted_at is None:
                r.first_admitted_at = step
                if measured:
                    waits.append(step - r.arrival)
            running.append(r)
        if not measured:
            continue
        tokens = sum(r.length for r in running)
        unusable = allocator.unusable_free(queue[0] if queue else None)
        stalls += unusable > 0
        running_counts.append(len(running))
        held.append(tokens)
        wasted.append(allocator.reserved() - tokens)
        fragmented.append(unusable)
        if step % 10 == 0:
            series.append((step, len(running), allocator.reserved() - tokens))
    budget = w.budget_tokens
    row = CapacityRow(
        allocator.name, completed, statistics.mean(running_counts), statistics.median(running_counts),
        _quantile(waits, 0.5), _quantile(waits, 0.95), statistics.mean(held) / budget,
        statistics.mean(wasted) / budget, statistics.mean(fragmented) / budget, preemptions, recomputed, stalls)
    return row, series


def _quantile(values: list[int], q: float) -> float:
    """Nearest rank; NaN when nothing was admitted."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def run_capacity_bench(w: CapacityWorkload) -> CapacityFigures:
    requests = make_requests(w)
    if not requests:
        raise ValueError("no request arrived: raise --steps or --arrivals")
    rows, series = [], {}
    for allocator in (Paged(w), FullWindow(w), ExactFirstFit(w)):
        row, s = simulate(allocator, requests, w)
        rows.append(row)
        series[allocator.name] = s
    prompts = sorted(r.prompt for r in requests)
    outputs = sorted(r.output for r in requests)
    return CapacityFigures(w, len(requests), statistics.mean(prompts), prompts[len(prompts) // 2], prompts[-1],
                           statistics.mean(outputs), outputs[len(outputs) // 2], outputs[-1], rows, series)
