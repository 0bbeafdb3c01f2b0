"""Codecs for a chunk payload: K/V values of one dtype, as one contiguous byte buffer.

    raw          the bytes as they are
    zstd         zstd over the bytes
    zstd-planes  byte planes, then zstd: for an itemsize-k dtype, all high bytes of
                 every value, then the next bytes, ..., then all low bytes. The high
                 bytes hold sign and exponent, which vary little across activations,
                 so they compress well once they are not interleaved with noisy
                 mantissa bytes.

Codecs are shared objects: `get_codec` hands out one per (name, level), and each
keeps zstd contexts per thread (a context is not thread-safe, and making one per
call costs more than compressing a small chunk).

Decoding takes a `between`, called after each SLICE_BYTES of its work: a load
that may use the CPU only in slices (between the engine's steps:
kvtierd/tiers/background_work.py) waits there for its next one.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Protocol, TypeAlias

import numpy as np
import zstandard

from kvtierd.storage.store_errors import CorruptValueError

# Fast levels: chunks are written on the eviction path, where speed beats ratio.
DEFAULT_LEVEL = 1

Buffer: TypeAlias = bytes | bytearray | memoryview
# Called between slices of a long piece of work (decoding, hashing a value): where a paced caller yields.
Between: TypeAlias = Callable[[], object]
# The work between two calls of a `between`: ~0.5 ms of decoding or hashing.
SLICE_BYTES = 1 << 20


def no_pause() -> None:
    """A `between` for callers that never yield."""


class Codec(Protocol):
    name: str

    def encode(self, data: Buffer, itemsize: int) -> bytes: ...

    def decode(self, data: Buffer, itemsize: int, nbytes: int, between: Between = no_pause) -> Buffer:
        """Inverse of encode; `nbytes` is the decoded size. Raises CorruptValueError."""
        ...


class RawCodec:
    name = "raw"

    def encode(self, data: Buffer, itemsize: int) -> bytes:
        return bytes(data)

    def decode(self, data: Buffer, itemsize: int, nbytes: int, between: Between = no_pause) -> memoryview:
        """A view of `data` itself: the caller copies what it keeps (a load copies it into the device)."""
        view = memoryview(data)
        if view.nbytes != nbytes:
            raise CorruptValueError("payload", f"raw payload has {view.nbytes} bytes, expected {nbytes}")
        return view


class ZstdCodec:
    name = "zstd"

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        self._contexts = _ZstdContexts(level)

    def encode(self, data: Buffer, itemsize: int) -> bytes:
        return self._contexts.cctx.compress(data)

    def decode(self, data: Buffer, itemsize: int, nbytes: int, between: Between = no_pause) -> memoryview:
        """Into a buffer of `nbytes` allocated once, a slice of output at a time; a frame that decodes to more or
        fewer bytes is corrupt."""
        out = np.empty(nbytes, dtype=np.uint8)
        view, got = memoryview(out), 0
        try:
            with self._contexts.dctx.stream_reader(data, read_across_frames=False) as reader:
                while got < nbytes and (n := reader.readinto(view[got : got + SLICE_BYTES])):
                    got += n
                    between()
                extra = reader.read(1)
        except zstandard.ZstdError as e:
            raise CorruptValueError("payload", f"zstd: {e}") from e
        if got != nbytes or extra:
            raise CorruptValueError("payload", f"zstd payload decodes to {'more than ' if extra else ''}{got} "
                                    f"bytes, expected {nbytes}")
        return view


class ZstdPlanesCodec(ZstdCodec):
    """Byte planes in one zstd frame. A tail shorter than one item (odd sizes) follows the planes as is."""

    name = "zstd-planes"

    def encode(self, data: Buffer, itemsize: int) -> bytes:
        planes, tail = _to_planes(data, itemsize)
        stream = self._contexts.cctx.compressobj(size=planes.nbytes + len(tail))
        parts = []
        for plane in planes:
            # A zstd block ends with each plane, so each plane gets entropy tables of its own:
            # without that, a chunk under zstd's 128 KiB block size gains nothing from planes.
            parts += [stream.compress(plane), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
        parts += [stream.compress(tail), stream.flush()]
        return b"".join(parts)

    def decode(self, data: Buffer, itemsize: int, nbytes: int, between: Between = no_pause) -> Buffer:
        return _from_planes(super().decode(data, itemsize, nbytes, between), itemsize, between)


class _ZstdContexts(threading.local):
    """A compressor and a decompressor per thread: zstd contexts are not thread-safe."""

    def __init__(self, level: int) -> None:
        # The content size goes into each frame, so decoding allocates its output once.
        self.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        self.dctx = zstandard.ZstdDecompressor()


def _to_planes(data: Buffer, itemsize: int) -> tuple[np.ndarray, bytes]:
    """[itemsize, num_items] byte planes, high byte first, and the bytes past the last whole item."""
    if itemsize < 1:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % itemsize
    items = raw[:whole].reshape(-1, itemsize)  # [num_items, itemsize], a view
    # The transposed copy is the one pass over the data.
    return np.ascontiguousarray(items[:, _HIGH_FIRST].T), raw[whole:].tobytes()


def _from_planes(data: Buffer, itemsize: int, between: Between) -> memoryview:
    """The items back from their planes, as a writable buffer (the tier manager copies it into the device)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % itemsize
    planes = raw[:whole].reshape(itemsize, -1)  # [itemsize, num_items], high byte first
    out = np.empty(len(raw), dtype=np.uint8)
    if itemsize == 2:
        _join_halves(planes, out[:whole].view(np.uint16), between)
    else:
        items = out[:whole].reshape(-1, itemsize)
        order = range(itemsize)[_HIGH_FIRST]
        for plane, byte in zip(planes, order):  # one strided write per plane: far faster than a transposed copy
            items[:, byte] = plane
            between()
    out[whole:] = raw[whole:]
    return memoryview(out)


def _join_halves(planes: np.ndarray, words: np.ndarray, between: Between) -> None:
    """2-byte items (bf16, f16: the KV dtypes) as words, high << 8 | low, SLICE_BYTES of them at a time: 1.7 ms
    for a 12 MB chunk against 3.5 for two strided byte writes (one thread, probe). The word's arithmetic is the
    host's own byte order, as the planes' high-first order is. For 4-byte items the shifts cost as much as the
    strided writes do."""
    step = SLICE_BYTES // 2
    for start in range(0, len(words), step):
        part = words[start : start + step]
        np.left_shift(planes[0, start : start + step], 8, out=part, dtype=np.uint16)
        np.bitwise_or(part, planes[1, start : start + step], out=part)
        between()


# Byte order within an item, high byte first: reversed on little-endian hosts.
_HIGH_FIRST = slice(None, None, -1) if sys.byteorder == "little" else slice(None)

_CODECS: dict[str, Callable[[int], Codec]] = {
    RawCodec.name: lambda level: RawCodec(),
    ZstdCodec.name: ZstdCodec,
    ZstdPlanesCodec.name: ZstdPlanesCodec,
}
CODEC_NAMES = tuple(_CODECS)


@functools.cache
def get_codec(name: str, level: int = DEFAULT_LEVEL) -> Codec:
    """The shared codec `name` (the level only matters when encoding). Raises ValueError for an unknown name."""
    try:
        make = _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}") from None
    return make(level)
