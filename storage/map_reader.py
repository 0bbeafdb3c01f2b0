"""Copying a value out of LMDB's read-only map by reading its file, not by touching the map.

A large LMDB value is a run of contiguous overflow pages, and a read transaction's
`get(buffers=True)` gives a view of them in the map. Copying from that view faults
the pages in a readahead window at a time, each fault a synchronous read when the
file is cold; one pread of the same range of data.mdb is served by the kernel's
large sequential readahead instead (1.3 to 1.6x faster cold on the bench host's
virtual disk). The pages cannot change under either: LMDB never rewrites a page
that an open read transaction can see, and it writes with write() (no writable
map), so the file and the map show the same bytes.

A load that yields to the engine's steps (`into_scratch` given `waiting`)
reads its value with direct I/O where the file system has it: the disk writes
the pages into the buffer, and no thread copies them out of the page cache,
reads ahead past the value or fills the cache. Such a read takes no core
while it waits, so the load waits for it outside its slices (`waiting`),
beside the steps; through the page cache, the copy, and the readahead that
went on after the read returned, slowed the forward that followed (a step log
beside `bench stall`'s disk loads: 2-5 forwards a load at 16-19 ms, against
11-12). The read covers the value's whole pages, and its first page's header
must name it (LMDB's overflow page header: the page's number, the overflow
flag, the run's length), or the value is read as below. A load in one piece
(nothing running beside it: a lone restore) reads through the page cache,
which serves a warm file from memory and a cold one with readahead of the next
value while this one is copied (direct, a 2,000-token turn's next turn in
`bench tiers`: 79 ms against 73 warm, 97 against 94 cold).

The file offset is the view's address minus the map's start, which py-lmdb does
not expose: it is read from /proc/self/maps. Anything unexpected (no /proc, the
map moved, a short read, ends that differ from the view's) falls back to
copying from the view, so a wrong offset costs speed, never bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

CHECKED_BYTES = 64  # of each end of a value, compared with the map's after the read
# The start of an LMDB page (MDB_page in lmdb's mdb.c): its number, padding, its flags and, on the first page of
# a large value's overflow run, the run's length in pages; the value follows it.
_PAGE_HEADER = struct.Struct("=QHHI")
_P_OVERFLOW = 0x04

Waiting = Callable[[], AbstractContextManager[None]]  # put around a wait that takes no core


class MapReader:
    def __init__(self, data_file: Path, page_size: int) -> None:
        self._path = os.path.realpath(data_file)
        self._page_size = page_size  # LMDB's: the OS page size, a multiple of any disk's direct I/O alignment
        self._fd = os.open(self._path, os.O_RDONLY)
        self._direct_fd = _open_direct(self._path)  # -1 where the file system has no direct I/O (tmpfs)
        self._base: int | None = None  # where the map of data.mdb starts in this process
        self._local = threading.local()  # each thread's reused buffers (`into_scratch`)

    def copy(self, view: memoryview) -> bytearray:
        """The value in a new buffer of its own."""
        out = bytearray(len(view))
        self._copy_into(view, memoryview(out))
        return out

    def into_scratch(self, view: memoryview, waiting: Waiting | None = None) -> memoryview:
        """The value in one of this thread's scratch buffers (reused: no pages to zero), valid until this
        thread's next call. Given `waiting`, read from the disk with direct I/O where it can be, `waiting()`
        around the read."""
        direct = self._read_direct(view, waiting) if waiting is not None else None
        if direct is not None:
            return direct
        scratch: bytearray | None = getattr(self._local, "scratch", None)
        if scratch is None or len(scratch) < len(view):
            scratch = self._local.scratch = bytearray(len(view))
        out = memoryview(scratch)[: len(view)]
        self._copy_into(view, out)
        return out

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._direct_fd = -1

    def _read_direct(self, view: memoryview, waiting: Waiting) -> memoryview | None:
        """The value's whole pages read with direct I/O into this thread's aligned buffer, and the value's
        bytes in it; None when that cannot be done or the first page is not the value's."""
        offset = self._offset(view) if self._direct_fd >= 0 and len(view) >= 2 * CHECKED_BYTES else None
        if offset is None:
            return None
        first = offset - _PAGE_HEADER.size
        if first % self._page_size:
            return None
        pages = -(-(len(view) + _PAGE_HEADER.size) // self._page_size)
        size = pages * self._page_size
        buffer: mmap.mmap | None = getattr(self._local, "aligned", None)  # anonymous maps start page-aligned
        if buffer is None or len(buffer) < size:
            # The old one is dropped, not closed: closing a map a caller's view still holds raises; it is unmapped
            # once the last view goes.
            buffer = self._local.aligned = mmap.mmap(-1, size)
        target = memoryview(buffer)[:size]
        try:
            with waiting():
                got = os.preadv(self._direct_fd, [target], first)
        except OSError:
            return None
        number, _, flags, run = _PAGE_HEADER.unpack_from(target)
        if got != size or number != first // self._page_size or not flags & _P_OVERFLOW or run != pages:
            return None
        return target[_PAGE_HEADER.size : _PAGE_HEADER.size + len(view)]

    def _copy_into(self, view: memoryview, out: memoryview) -> None:
        if not self._read(view, out):
            out[:] = view

    def _read(self, view: memoryview, out: memoryview) -> bool:
        n = len(view)
        if n < 2 * CHECKED_BYTES:
            return False  # small: the map's copy is as good
        offset = self._offset(view)
        if offset is None:
            return False
        try:
            got = os.preadv(self._fd, [out], offset)
        except OSError:
            got = 0
        k = CHECKED_BYTES
        if got == n and out[:k] == view[:k] and out[n - k :] == view[n - k :]:
            return True
        self._base = None  # the map moved (or was never where we thought): looked up again next time
        return False

    def _offset(self, view: memoryview) -> int | None:
        """Where the view's bytes lie in data.mdb, as the map's start says; None when it cannot be told."""
        base = self._base if self._base is not None else self._find_base()
        if base is None:
            return None
        offset = np.frombuffer(view, np.uint8).__array_interface__["data"][0] - base
        return offset if offset >= 0 else None

    def _find_base(self) -> int | None:
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].rstrip("\n") == self._path and int(fields[2], 16) == 0:
                        self._base = int(fields[0].split("-")[0], 16)
                        return self._base
        except (OSError, ValueError):
            pass
        return None


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
