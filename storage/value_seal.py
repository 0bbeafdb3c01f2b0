"""Sealed values: an HMAC-SHA256 tag binds each remote value to its key under the fleet's secret.

    sealed = tag || frame        tag = HMAC-SHA256(secret, u16 key length || key || frame), 32 bytes

Whoever can write to the shared Redis can write bytes, but without the secret
none that pass: a planted or altered value, a value copied to another key
(another chunk, model, geometry or fleet: the key holds them all), or one
sealed under another secret is refused. The frame's own checks (checksum,
identity) still run at the caller; the tag is what lets them be trusted when a
writer means harm, since a forger can recompute a checksum but not a tag.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from kvtierd.storage.codecs import SLICE_BYTES, Between, Buffer, no_pause
from kvtierd.storage.store_errors import StoreArgumentError

MIN_SECRET_BYTES = 16
TAG_BYTES = hashlib.sha256().digest_size
_KEY_LENGTH = struct.Struct("<H")


class ValueSeal:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise StoreArgumentError(
                f"the fleet secret has {len(secret)} bytes, needs at least {MIN_SECRET_BYTES} "
                "(e.g. 32 random bytes: `openssl rand -hex 32`), the same on every host of the fleet"
            )
        self._secret = secret
        # Names the secret in keys without revealing it: daemons holding different secrets (a rotation
        # under way, a misconfigured host) then use disjoint keys, instead of deleting each other's
        # values as forged.
        self.key_id = hmac.new(secret, b"kvtierd redis key id", hashlib.sha256).hexdigest()[:8]

    def seal(self, key: bytes, frame: Buffer) -> bytes:
        return self._tag(key, frame) + frame

    def unseal(self, key: bytes, sealed: bytes, between: Between = no_pause) -> memoryview | None:
        """The frame, a read-only view into `sealed` (not a copy: values are megabytes), or None if the tag
        does not match (forged, altered, moved, or another secret's)."""
        if len(sealed) < TAG_BYTES:
            return None
        frame = memoryview(sealed)[TAG_BYTES:]
        if not hmac.compare_digest(sealed[:TAG_BYTES], self._tag(key, frame, between)):
            return None
        return frame

    def _tag(self, key: bytes, frame: Buffer, between: Between = no_pause) -> bytes:
        mac = hmac.new(self._secret, _KEY_LENGTH.pack(len(key)), hashlib.sha256)
        mac.update(key)
        view = memoryview(frame)  # in place: frames are megabytes, never concatenated with the key
        for at in range(0, len(view), SLICE_BYTES):
            mac.update(view[at : at + SLICE_BYTES])
            between()
        return mac.digest()
