"""Where a large value lies in data.mdb, so that reading it goes to the file and never through LMDB's map.

py-lmdb's `get` touches every page of the value it returns (with the GIL
released) before it returns, so a cold value is read there, in page faults a
readahead window at a time, and any read of it after that is a second one. A
paced load that read its value through `get` and then with direct I/O read it
twice, the first time inside its slice: lends of 8-17 ms where 3-4 were meant
(a step log beside `kvtierd bench stall`).

A large value is a run of contiguous overflow pages that stays where it was
written until the value is deleted, so its place is taken once, when it is
written: the first page's number (from that page's header, in the write
transaction, right before the value's bytes), its length and a hash of its key
and its ends. It is kept in the `places` sub-database, written and deleted with
the value in the same transaction.

A read at a place covers the run's whole pages, and what it finds must be that
value: the first page's header names the page, the overflow flag and the run's
length, and the key and the ends hash to what was kept (a place of another
key's value does not pass). Anything else (a damaged record, a file written by
another tool) makes `read` return None and the caller reads through `get`, so
a wrong place costs speed, never bytes.

A load that yields to the engine's steps (`waiting` given) reads a cold value
with direct I/O where the file system has it: the disk writes the pages into
the buffer, nothing is read ahead past the value or left in the cache, and the
read holds no core, so the load waits for it beside the steps (`waiting`).
Whether the value is cold is mincore's answer over a map of its pages that is
never touched (a pread with RWF_NOWAIT starts reading ahead when they are not
there); a warm one is copied from the page cache. Any other read (a lone
restore, warming the host tier) goes through the page cache: warm, it is
memory; cold, the kernel's readahead brings the next value meanwhile (`kvtierd
bench tiers`, a 2,000-token turn's next turn restored from a cold disk: 82 ms
read buffered, 88 direct, one run each).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import xxhash

# The start of an LMDB page (MDB_page in lmdb's mdb.c): its number, padding, its flags and, on the first page of
# a large value's overflow run, the run's length in pages; the value follows it.
PAGE_HEADER = struct.Struct("=QHHI")
P_OVERFLOW = 0x04
ENDS_BYTES = 64  # of each end of a value, hashed into its place
_PLACE = struct.Struct("<QQQ")

Waiting = Callable[[], AbstractContextManager[None]]  # put around a wait that holds no core
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class ValuePlace:
    page: int  # the number of the first page of the value's overflow run
    length: int  # the value's bytes
    ends: int  # xxh3_64 of its key and its first and last ENDS_BYTES

    def pack(self) -> bytes:
        return _PLACE.pack(self.page, self.length, self.ends)

    @classmethod
    def unpack(cls, record: bytes) -> ValuePlace | None:
        """None for a record of another size (a damaged page): the value is read through `get` then."""
        return cls(*_PLACE.unpack(record)) if len(record) == _PLACE.size else None

    def pages(self, page_size: int) -> int:
        return -(-(self.length + PAGE_HEADER.size) // page_size)


def place_of(key: bytes, view: memoryview, page_size: int) -> ValuePlace | None:
    """The place of the value just put under `key`, from its view in the write transaction (its run of pages in
    memory, whose first page's header lies right before the value's bytes); None for a value in a leaf page."""
    if len(view) <= page_size:  # may share a leaf page: no header of its own before it
        return None
    address = np.frombuffer(view, np.uint8).ctypes.data
    page, _, flags, run = PAGE_HEADER.unpack(ctypes.string_at(address - PAGE_HEADER.size, PAGE_HEADER.size))
    place = ValuePlace(page, len(view), _ends(key, view))
    return place if flags & P_OVERFLOW and run == place.pages(page_size) else None


def _ends(key: bytes, value: memoryview) -> int:
    k = min(ENDS_BYTES, len(value))
    hasher = xxhash.xxh3_64(key)
    hasher.update(value[:k])
    hasher.update(value[len(value) - k :])
    return hasher.intdigest()


class PlaceReader:
    """Reads values at their places in one data.mdb, into each thread's reused buffers."""

    def __init__(self, data_file: str | os.PathLike[str], page_size: int) -> None:
        path = os.path.realpath(data_file)
        self._page_size = page_size  # LMDB's: the OS page size, a multiple of any disk's direct I/O alignment
        self._fd = os.open(path, os.O_RDONLY)
        self._direct_fd = _open_direct(path)  # -1 where the file system has no direct I/O (tmpfs)
        self._local = threading.local()

    def read(self, key: bytes, place: ValuePlace, waiting: Waiting | None = None,
             own: bool = False) -> memoryview | None:
        """The value of `key` at `place`: in this thread's buffer (valid until its next read; do not keep it), or
        with `own` in a buffer of its own. Given `waiting`, a value the page cache does not hold is read with
        direct I/O, `waiting()` around the read. None when what lies there is not that value."""
        size = place.pages(self._page_size) * self._page_size
        offset = place.page * self._page_size
        try:
            if offset + size > os.fstat(self._fd).st_size:  # a damaged record: nothing that large is there
                return None
            if waiting is not None and self._direct_fd >= 0 and not self._cached(offset, size):
                target = self._buffer("aligned", size)
                with waiting():
                    got = os.preadv(self._direct_fd, [target], offset)
            else:
                target = memoryview(bytearray(size)) if own else self._buffer("scratch", size)
                got = os.preadv(self._fd, [target], offset)
        except (OSError, ValueError):  # ValueError: a map of the range refused
            return None
        if got != size:
            return None
        page, _, flags, run = PAGE_HEADER.unpack_from(target)
        value = target[PAGE_HEADER.size : PAGE_HEADER.size + place.length]
        ours = page == place.page and flags & P_OVERFLOW and run == size // self._page_size
        return value if ours and _ends(key, value) == place.ends else None

    def _cached(self, offset: int, size: int) -> bool:
        """Whether the page cache holds every page of [offset, offset + size)."""
        pages = (ctypes.c_ubyte * (size // mmap.PAGESIZE))()
        with mmap.mmap(self._fd, size, prot=mmap.PROT_READ, offset=offset) as window:  # never touched: no I/O
            start = np.frombuffer(window, np.uint8)
            listed = _LIBC.mincore(ctypes.c_void_p(start.ctypes.data), ctypes.c_size_t(size), pages) == 0
            del start  # before the map closes
        return listed and bool(np.all(np.frombuffer(pages, np.uint8) & 1))

    def copy(self, view: memoryview, own: bool = False) -> memoryview:
        """A value read through `get` (its pages in memory now), copied into this thread's scratch buffer, or
        with `own` into a buffer of its own."""
        out = memoryview(bytearray(len(view))) if own else self._buffer("scratch", len(view))
        out[:] = view
        return out

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1

    def _buffer(self, kind: str, size: int) -> memoryview:
        """This thread's reused buffer of `kind` with at least `size` bytes: "aligned" (an anonymous map, page
        aligned, for direct I/O) or "scratch"; no pages are zeroed per read."""
        buffer = getattr(self._local, kind, None)
        if buffer is None or len(buffer) < size:
            # The old one is dropped, not closed: closing a map a caller's view still holds raises; it is unmapped
            # once the last view goes.
            buffer = mmap.mmap(-1, size) if kind == "aligned" else bytearray(size)
            setattr(self._local, kind, buffer)
        return memoryview(buffer)[:size]


def _open_direct(path: str) -> int:
    """A descriptor of `path` for direct I/O, or -1 where there is none (no O_DIRECT, or a file system without
    it, which refuses the open with EINVAL)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1
        raise
