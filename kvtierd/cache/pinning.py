"""Pinning prefixes and sessions on the device or in a lower tier: what a pin request becomes.

A device pin holds pages (`cache/pins.py`); a pin in the host or disk tier
holds the chain's chunks there (`TierPins.pin`, `tiers/tier_pins.py`, under a budget of its own)
and no device page. A pinned session's pin follows it from turn to turn
(`follow_session`, after each turn is kept) and its pool never expires.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtierd.cache.block_hash import BlockHashes
from kvtierd.cache.pins import Pin, PinBudgetError, PinError, Pins
from kvtierd.cache.prefix_lookup import PrefixLookup
from kvtierd.cache.session_pool import SessionKey, SessionPools
from kvtierd.cache.stores_below import StoresBelow
from kvtierd.tiers.chunk import ChunkCopy
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.tier_pins import PIN_TIERS, TierPinError

log = logging.getLogger(__name__)


class Pinning:
    def __init__(self, pins: Pins, lookup: PrefixLookup, stores: StoresBelow, sessions: SessionPools,
                 tiers: TierManager | None, clock: Callable[[], float]) -> None:
        self.pins = pins
        self.pool = pins.pool
        self._lookup = lookup
        self._stores = stores
        self._sessions = sessions
        self._tiers = tiers
        self._clock = clock

    def pin_prefix(self, pin_id: str, hashes: BlockHashes, token_ids: Sequence[int], ttl_s: float | None = None,
                   tier: str = "device") -> Pin | None:
        """Pins the full pages of `token_ids` (in the namespace of `hashes`) on the device, or their chunks in
        the host or disk tier; None when they are not all cached (compute the prefix, then pin again). Raises
        PinError (over budget, too short, no such tier)."""
        bs = self._lookup.block_size
        n = len(token_ids) // bs
        if n == 0:
            raise PinError(f"a prefix of {len(token_ids)} tokens has no full page of {bs} to pin")
        pin = Pin(pin_id, "prefix", hashes.root, self._expiry(ttl_s), tuple(token_ids), tier=tier)
        full = token_ids[: n * bs]
        chain = hashes.of_full_pages(full)  # whether or not its pages are on the device
        blocks = self._lookup.pages(chain, full)
        if tier != "device":
            return self._pin_below(pin, self._stores.copies(hashes.root, chain, full, blocks))
        if len(blocks) < n:
            return None
        return self.pins.add(pin, blocks)

    def pin_session(self, pin_id: str, key: SessionKey, ttl_s: float | None = None, tier: str = "device") -> Pin:
        """Pins a session's context pool (its resident pages on the device, its chunks in the host or disk
        tier) and keeps pinning it as it grows (see cache/pins.py)."""
        pin = Pin(pin_id, "session", key[0], self._expiry(ttl_s), session_id=key[1], tier=tier)
        if tier != "device":
            pinned = self._pin_below(pin, self._session_copies(key))
            if pinned is None:
                raise PinError(f"session {key[1]!r}'s KV is neither on the device nor in the {tier} tier any more; "
                               "pin it after its next turn")
            return pinned
        return self.pins.add(pin, self._resident_pages(key))

    def unpin(self, pin_id: str) -> Pin | None:
        pin = self.pins.remove(pin_id)
        if pin is not None and pin.tier != "device" and self._tiers is not None:
            self._tiers.pins.unpin(pin_id)
        return pin

    def follow_session(self, key: SessionKey, block_ids: list[int]) -> None:
        """A session kept its turn on `block_ids`: its pin, if any, follows (on the device: as many leading
        pages as the budget allows; below: its new chunks are written there now, on this thread, and past the
        tier's budget the pin keeps what it held)."""
        pin = self.pins.session_pin(key)
        if pin is None:
            return
        if pin.tier == "device":
            self.pins.follow(pin, block_ids)
            return
        try:
            self._pin_below(pin, self._session_copies(key))
        except PinError as e:
            log.warning("pin %s keeps its earlier turns only: %s", pin.pin_id, e)

    def pinned_sessions(self) -> set[SessionKey]:
        return {p.session_key for p in self.pins if p.session_key is not None}

    def expire(self, now: float | None = None) -> None:
        for pin in self.pins.expire(now):
            if pin.tier != "device" and self._tiers is not None:
                self._tiers.pins.unpin(pin.pin_id)

    def _resident_pages(self, key: SessionKey) -> list[int]:
        chain = self._sessions.get(key)
        return [] if chain is None else chain.resident(self.pool.generation)

    def _session_copies(self, key: SessionKey) -> list[ChunkCopy]:
        """The chunks of a session's chain, with the device pages of those still resident."""
        chain = self._sessions.get(key)
        if chain is None:
            return []
        if chain.public_blocks:
            raise PinError("a session that starts with a public prefix can be pinned on the device only")
        return self._stores.copies(key[0], chain.block_hashes, chain.token_ids, self._resident_pages(key))

    def _pin_below(self, pin: Pin, copies: list[ChunkCopy]) -> Pin | None:
        if pin.tier not in PIN_TIERS:
            raise PinError(f"tier must be device, {' or '.join(PIN_TIERS)}, not {pin.tier!r}")
        if self._tiers is None:
            raise PinError(f"there is no {pin.tier} tier: turn the lower tiers on, or pin to the device")
        share = self.pins.budget_pages / self.pool.num_blocks
        try:
            if not self._tiers.pins.pin(pin.tier, pin.pin_id, copies, share):
                return None
        except TierPinError as e:
            raise (PinBudgetError if "budget" in str(e) else PinError)(str(e)) from e
        return self.pins.add(pin, [])

    def _expiry(self, ttl_s: float | None) -> float | None:
        return None if ttl_s is None else self._clock() + ttl_s
