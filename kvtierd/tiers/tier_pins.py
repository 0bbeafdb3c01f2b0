"""Pins below the device: which chunks of the host and disk tiers each pin holds, and the pin budget of each
tier (a share of its capacity). A chunk two pins hold stays pinned until both let it go; what no pin holds any
more goes back to its tier's LRU. The fleet's tier is not pinned here: it is shared, and its TTL rules it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtierd.storage.geometry import KVGeometry
from kvtierd.tiers.backend import PinnableBackend
from kvtierd.tiers.chunk import ChunkCopy
from kvtierd.tiers.epoch import Epoch
from kvtierd.tiers.tier import Tier

PIN_TIERS = (Tier.HOST, Tier.DISK)  # the tiers this host owns


class TierPinError(ValueError):
    """A pin below the device that cannot be made as asked (its tier is off, or over its pin budget)."""


@dataclass(frozen=True, slots=True)
class TierPin:
    tier: Tier  # one of PIN_TIERS
    keys: tuple[bytes, ...]  # the chunks it holds
    nbytes: int  # their KV bytes: what counts against the tier's pin budget


class TierPins:
    """Pin id -> `TierPin`. `backend(tier)` is the tier's usable pinnable backend, None when it is off or not
    pinnable; `off_reason(tier)` says why."""

    def __init__(self, backend: Callable[[Tier], PinnableBackend | None], off_reason: Callable[[Tier], str],
                 epoch: Epoch, geometry: KVGeometry) -> None:
        self._backend = backend
        self._off_reason = off_reason
        self._epoch = epoch
        self._geometry = geometry
        self._pins: dict[str, TierPin] = {}

    def __getitem__(self, pin_id: str) -> TierPin:
        return self._pins[pin_id]

    def __contains__(self, pin_id: object) -> bool:
        return pin_id in self._pins

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, tier: str, pin_id: str, copies: Sequence[ChunkCopy], share: float) -> bool:
        """Pins a chain's chunks in `tier` for `pin_id`, in place of what it pinned before. A chunk the tier
        lacks is saved there first from the device pages of its copy (a copy without pages must be there
        already). False when a chunk is neither there nor on the device. Raises TierPinError when the tier is
        off or the pin would take more than `share` of its capacity."""
        tier = Tier(tier)
        backend = self._backend(tier)
        if backend is None:
            raise TierPinError(f"there is no {tier} tier to pin to ({self._off_reason(tier)}); pin to the device, "
                               "or turn it on")
        keys = tuple(self._epoch.key(c.span.last_hash) for c in copies)
        nbytes = sum(c.span.num_pages for c in copies) * self._geometry.bytes_per_block
        old = self._pins.get(pin_id)
        budget = int(share * backend.capacity_bytes)
        others = sum(p.nbytes for i, p in self._pins.items() if p.tier == tier and i != pin_id)
        if others + nbytes > budget:
            raise TierPinError(f"this pin needs {nbytes >> 20} MiB of the {tier} tier and would make "
                               f"{(others + nbytes) >> 20} MiB pinned there, over its pin budget of "
                               f"{budget >> 20} MiB; unpin something or raise [qos] pin_share")
        missing = [(c, key) for c, key in zip(copies, keys) if not backend.has(key)]
        if any(not c.block_ids for c, _ in missing):
            return False
        for c, key in missing:
            backend.store_now(key, c.span.identity(self._geometry), c.block_ids)
        if backend.pin(keys) != len(keys):  # a write failed, or another chunk's write evicted one
            backend.unpin(keys)
            return False
        self._pins[pin_id] = TierPin(tier, keys, nbytes)
        if old is not None:  # a session pin following its session: what it no longer holds goes back to the LRU
            self._release(old)
        return True

    def unpin(self, pin_id: str) -> TierPin | None:
        pin = self._pins.pop(pin_id, None)
        if pin is not None:
            self._release(pin)
        return pin

    def pinned_bytes(self, tier: str) -> int:
        return sum(p.nbytes for p in self._pins.values() if p.tier == tier)

    def empty_all(self) -> None:
        """Lets every pin's chunks go (they became unreachable: a new epoch); the pins stay, holding nothing."""
        for pin_id, pin in self._pins.items():
            if (backend := self._backend(pin.tier)) is not None:
                backend.unpin(pin.keys)
            self._pins[pin_id] = TierPin(pin.tier, (), 0)

    def _release(self, pin: TierPin) -> None:
        """Unpins a pin's chunks that no other pin holds (call once it is out of `_pins`)."""
        held = {k for p in self._pins.values() if p.tier == pin.tier for k in p.keys}
        backend = self._backend(pin.tier)
        if backend is not None:
            backend.unpin([k for k in pin.keys if k not in held])
