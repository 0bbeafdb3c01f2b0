"""Weighted shares of a cache among its owners (tenants), for every tier: who stands highest goes first.

    standing(o) = held(o) / weight(o)
    share(o)    = all held * weight(o) / (sum of the weights of the owners holding something, o included)

`held` is what the tier counts: device pages (cache/cache_shares.py), host slots (host_store.py), disk bytes
(disk_store.py). An owner above its share has a standing above the average, so taking from the highest
standing first never takes from an owner under its share while one above it still has something to give.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class OwnerUsage:
    """What one owner holds in a tier now, and its batches refused at its limit since open (disk, remote)."""

    entries: int
    nbytes: int  # what the limit counts (disk: the values' charges; remote: their sealed bytes)
    over_limit: int


def by_standing(held: Mapping[K, float], weight: Callable[[K], float]) -> list[K]:
    """The owners holding something, highest standing first (ties: in `held`'s order)."""
    return sorted((o for o, n in held.items() if n > 0), key=lambda o: -held[o] / weight(o))


class WeightedShares(Generic[K]):
    """What each owner holds, against its weighted share. `weight` must give an owner the same weight
    while it holds something (the sum of the holders' weights is kept as they come and go)."""

    def __init__(self, weight: Callable[[K], float]) -> None:
        self.weight = weight
        self.held: Counter[K] = Counter()
        self._weight_sum = 0.0  # of the owners holding something

    def add(self, owner: K, n: int = 1) -> None:
        if not self.held[owner]:
            self._weight_sum += self.weight(owner)
        self.held[owner] += n

    def remove(self, owner: K, n: int = 1) -> None:
        self.held[owner] -= n
        if self.held[owner] <= 0:
            del self.held[owner]
            self._weight_sum -= self.weight(owner)

    def standing(self, owner: K) -> float:
        return self.held[owner] / self.weight(owner)

    def share(self, owner: K) -> float:
        """What this owner is entitled to now."""
        weight = self.weight(owner)
        others = self._weight_sum - (weight if self.held[owner] else 0.0)
        return sum(self.held.values()) * weight / (others + weight)

    def is_under_share(self, owner: K) -> bool:
        return self.held[owner] < self.share(owner)
