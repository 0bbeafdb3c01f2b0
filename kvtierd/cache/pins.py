"""Pins: prefixes and sessions whose pages are never evicted while pinned.

A pin names its tier. On the device (the default) it holds pages, as below;
on the host or disk tier it holds the chain's chunks there (the tier manager
keeps them out of its LRU, under a budget of its own: `TierPins.pin`, `tiers/tier_pins.py`), and
no device page.

A pin holds every page of its chain from the first one (pinning only a tail
would not help: evicting an unpinned head strands it). A prefix pin holds the
full pages of its token ids; a session pin holds its context pool's pages and
follows the session from turn to turn (a session pinned before it has a pool,
e.g. restored at startup, holds nothing until its next turn ends).

Pins share a budget of device pages, counted once however many pins hold a
page: a pin that would pass it is refused (`PinBudgetError`), and a pinned
session that grows past it keeps its leading pages that fit. A pin may expire
(`expires_at`, on the pool's clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvtierd.cache.block_hash import BlockHash
from kvtierd.cache.block_pool import BlockPool
from kvtierd.cache.page_remap import PageRemap
from kvtierd.cache.session_pool import SessionKey


class PinError(ValueError):
    """A pin that cannot be made as asked (a user's mistake, with a hint)."""


class PinBudgetError(PinError):
    """A pin that would take more device pages than the pin budget leaves."""


@dataclass(slots=True)
class Pin:
    pin_id: str
    kind: str  # "prefix" or "session"
    root: BlockHash  # its namespace
    expires_at: float | None  # None: until unpinned
    token_ids: tuple[int, ...] = ()  # a prefix pin's tokens
    session_id: str | None = None  # a session pin's session
    block_ids: list[int] = field(default_factory=list)  # the pages it holds, from the chain's start
    tier: str = "device"  # "device", "host" or "disk"

    @property
    def session_key(self) -> SessionKey | None:
        return None if self.session_id is None else (self.root, self.session_id)


class Pins:
    def __init__(self, pool: BlockPool, budget_pages: int, clock: Callable[[], float]) -> None:
        self.pool = pool
        self.budget_pages = budget_pages
        self._clock = clock
        self._pins: dict[str, Pin] = {}

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def session_pin(self, key: SessionKey) -> Pin | None:
        return next((p for p in self._pins.values() if p.session_key == key), None)

    def add(self, pin: Pin, block_ids: list[int]) -> Pin:
        """Pins `block_ids` for `pin` (replacing a pin of the same id), or raises PinBudgetError."""
        old = self._pins.get(pin.pin_id)
        after = self._pinned_after(old, block_ids)
        if after > self.budget_pages:
            raise PinBudgetError(
                f"this pin needs {len(block_ids)} device pages and would make {after} pinned, over the pin "
                f"budget of {self.budget_pages} ({self.pool.num_pinned_blocks} pinned now); unpin something "
                "or raise [qos] pin_share")
        self._move(pin, old, block_ids)
        self._pins[pin.pin_id] = pin
        return pin

    def follow(self, pin: Pin, block_ids: list[int]) -> None:
        """Moves a session pin to its session's new pages: as many leading ones as the budget allows."""
        n = len(block_ids)
        while n and self._pinned_after(pin, block_ids[:n]) > self.budget_pages:
            n -= 1
        self._move(pin, pin, block_ids[:n])

    def _move(self, pin: Pin, old: Pin | None, block_ids: list[int]) -> None:
        self.pool.pin(block_ids)  # before unpinning the old pages: those it keeps never go free
        if old is not None:
            self.pool.unpin(old.block_ids)
        pin.block_ids = list(block_ids)

    def _pinned_after(self, old: Pin | None, block_ids: list[int]) -> int:
        """Pinned pages if `old`'s pages were replaced by `block_ids`."""
        new = set(block_ids)
        freed = {b for b in (old.block_ids if old else ()) if b not in new and self._holders(b) == 1}
        added = {b for b in new if not self.pool.is_pinned(b)}
        return self.pool.num_pinned_blocks - len(freed) + len(added)

    def remove(self, pin_id: str) -> Pin | None:
        pin = self._pins.pop(pin_id, None)
        if pin is not None:
            self.pool.unpin(pin.block_ids)
        return pin

    def expire(self, now: float | None = None) -> list[Pin]:
        """Removes and returns the pins past their expiry."""
        now = self._clock() if now is None else now
        gone = [p.pin_id for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now]
        return [pin for pin_id in gone if (pin := self.remove(pin_id)) is not None]

    def remap(self, remap: PageRemap) -> None:
        """Renames the pages each pin holds (compaction; the block pool renames its pin counts)."""
        for pin in self._pins.values():
            pin.block_ids = remap.ids(pin.block_ids)

    def _holders(self, block_id: int) -> int:
        return sum(block_id in p.block_ids for p in self._pins.values())
