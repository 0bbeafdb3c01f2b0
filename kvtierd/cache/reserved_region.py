"""The reserved region: device pages only the high class may take.

Paged memory has no physical regions, so the region is a quota kept by the
block pool. With `R` reserved pages and `H` pages held by high-class
sequences, the unused reserve is `max(0, R - H)`: a lower-class allocation
is granted only if at least that many free pages remain after it. High takes
any free page; once it holds more than `R` it borrows from the shared pages
like everyone else.

    free pages:  [ . . . . . . . . . . ]
                   lower may take ^      ^-- the last R - H: high only

The size can follow the high class's demand (`window_s` > 0): each step
reports the pages high holds; the p99 of the samples of the last `window_s`
seconds, with 50% headroom, clamped to [floor, ceiling], becomes the new size
when it differs by more than a tenth (so it does not flap).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

HEADROOM = 1.5  # grow ahead of peaks: the reserve is the p99 of demand plus half of it
SAMPLES_PER_WINDOW = 200  # samples kept per window: p99 over them is cheap to recompute


@dataclass(frozen=True, slots=True)
class Resize:
    at: float  # clock time of the resize
    old_pages: int
    new_pages: int
    p99_pages: int  # the demand it followed


@dataclass(slots=True)
class ReservedRegion:
    pages: int  # reserved now
    floor: int
    ceiling: int
    window_s: float = 0.0  # 0: a fixed size
    _samples: deque[tuple[float, int]] = field(default_factory=deque)
    history: list[Resize] = field(default_factory=list)  # every resize, oldest first

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.pages <= self.ceiling:
            raise ValueError(f"the reserve must satisfy floor {self.floor} <= size {self.pages} <= "
                             f"ceiling {self.ceiling}")

    def unused(self, high_pages: int) -> int:
        """Free pages lower classes must leave alone."""
        return max(0, self.pages - high_pages)

    def observe(self, now: float, high_pages: int) -> Resize | None:
        """Records the high class's page use; returns the resize it caused, if any."""
        if not self.window_s:
            return None
        if self._samples and now - self._samples[-1][0] < self.window_s / SAMPLES_PER_WINDOW:
            if high_pages <= self._samples[-1][1]:
                return None
            self._samples.pop()  # keep the peak of this sample's slot
        self._samples.append((now, high_pages))
        while now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        demand = sorted(n for _, n in self._samples)
        p99 = demand[min(len(demand) - 1, math.ceil(0.99 * len(demand)) - 1)]
        target = min(self.ceiling, max(self.floor, math.ceil(p99 * HEADROOM)))
        if abs(target - self.pages) <= max(1, self.pages // 10) and target not in (self.floor, self.ceiling):
            return None
        if target == self.pages:
            return None
        resize = Resize(now, self.pages, target, p99)
        self.pages = target
        self.history.append(resize)
        return resize
