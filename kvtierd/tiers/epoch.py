"""The lower tiers' epoch: mixed into every chunk key, so renewing it makes all that was stored unreachable.

That is how invalidation reaches host and disk without enumerating keys: values
stored under an old epoch are never found again and the LRU reclaims their room.
With a disk tier the epoch lives in `<kv dir>/epoch` (so a restart keeps what
was stored, and an invalidation stays done); without one it is per process.
A file that is missing or unreadable gives a new epoch: at worst the disk tier
starts cold, never serving what was invalidated.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

EPOCH_BYTES = 8


class Epoch:
    def __init__(self, directory: Path | None) -> None:
        self._path = None if directory is None else directory / "epoch"
        self.value = self._read()
        if self.value is None:
            self.value = secrets.token_bytes(EPOCH_BYTES)
            self.save(self.value)

    def key(self, block_hash: bytes) -> bytes:
        """The store key of a chunk whose last page has `block_hash`."""
        return xxhash.xxh3_128(self.value + block_hash).digest()

    def renew(self) -> bytes:
        """A new epoch from now on; returns it for `save` (the caller runs that off the event loop)."""
        self.value = secrets.token_bytes(EPOCH_BYTES)
        return self.value

    def save(self, value: bytes) -> None:
        """Writes `value` durably (write, fsync, rename); a failure is logged and leaves the old file."""
        if self._path is None:
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(value.hex().encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except OSError as e:
            log.warning("cannot save the KV tiers' epoch to %s: %s", self._path, e)

    def _read(self) -> bytes | None:
        if self._path is None:
            return None
        try:
            value = bytes.fromhex(self._path.read_text().strip())
        except (OSError, ValueError):
            return None
        return value if len(value) == EPOCH_BYTES else None
