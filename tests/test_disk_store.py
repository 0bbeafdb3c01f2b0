"""The LMDB disk tier, on real LMDB files: batches, LRU eviction, crash safety, refusals, quarantine."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import lmdb
import numpy as np
import pytest
from chunk_fixtures import CRASH_BATCH, crash_chunk, make_identity, make_payload

from kvtierd.storage.disk_store import MAX_QUARANTINED, DiskStore
from kvtierd.storage.kv_frame import decode_frame, encode_frame
from kvtierd.storage.value_places import ValuePlace, _open_direct
from kvtierd.storage.store_errors import CorruptValueError, StoreUnavailableError

TESTS = Path(__file__).resolve().parent
MAP_SIZE = 16 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value(i: int, nbytes: int = 1000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    s = DiskStore(tmp_path, map_size=MAP_SIZE)
    yield s
    s.close()


def test_put_get_contains_delete(store: DiskStore) -> None:
    assert store.put_many([(key(i), value(i)) for i in range(3)])
    assert store.get_many([key(0), key(9), key(2)]) == [value(0), None, value(2)]
    assert store.contains_prefix([key(0), key(1), key(2)]) == 3
    assert store.contains_prefix([key(0), key(9), key(2)]) == 1
    assert store.contains_each([key(9), key(2), key(0)]) == [False, True, True]  # past a miss too
    assert store.contains_prefix([]) == 0 and store.contains_each([]) == []
    assert store.delete_many([key(1), key(9)]) == 1
    assert store.contains_prefix([key(0), key(1), key(2)]) == 1
    stats = store.stats()
    assert (stats.num_entries, stats.num_puts, stats.num_gets, stats.num_hits) == (2, 3, 3, 2)
    assert stats.healthy and stats.reason is None
    assert 0 < stats.bytes_used < stats.capacity_bytes == MAP_SIZE


def test_a_cold_large_value_is_read_with_direct_io_inside_the_callers_waiting(store: DiskStore,
                                                                              tmp_path: Path) -> None:
    """A large value whose pages are not all in the page cache is read straight from the disk into a
    page-aligned buffer, with the caller's `waiting` around the read; one in the cache is copied from there (no
    wait), and a small one (it may share a leaf page: no place of its own) is read through LMDB. Same bytes every
    way, at sizes that fill their last page exactly or not."""
    if _open_direct(str(tmp_path / "data.mdb")) < 0:
        pytest.skip("the file system under the test's directory has no direct I/O")
    sizes = [100, 1000, 3000, 4096 - 16, 4096 * 3 - 16, 4096 * 3 - 15, 5 << 20]
    assert store.put_many([(key(n), value(n, n)) for n in sizes])
    waits: list[int] = []

    @contextmanager
    def waiting() -> Iterator[None]:
        waits.append(1)
        yield

    def read(n: int) -> tuple[bool, bool]:
        """Whether the read waited, and whether its bytes were in the page-aligned buffer."""
        waits.clear()
        got = store.read(key(n), lambda v: (bytes(v), isinstance(v.obj, mmap.mmap)), waiting)
        assert got is not None and got[0] == value(n, n), n
        return bool(waits), got[1]

    for n in sizes:  # just written: in the page cache
        assert read(n) == (False, False), n
    store.close()  # nothing of the file mapped: the cache drops it all
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    _drop_page_cache(tmp_path / "data.mdb")
    # The large value is cold (pages near the ones LMDB's reads map may stay: the small values' are not checked).
    assert read(5 << 20) == (True, True)
    assert read(5 << 20) == (True, True)  # a direct read leaves nothing in the cache
    for n in sizes:
        waited, aligned = read(n)
        assert waited == aligned and (n > 4096 or not waited), n  # only a value with a place is read direct
    (tmp_path / "data.mdb").read_bytes()  # warm again
    assert [read(n) for n in sizes] == [(False, False)] * len(sizes)
    assert store.read(key(1), bytes, waiting) is None
    # A view a caller still holds survives a larger read that needs a larger buffer.
    store.close()
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    _drop_page_cache(tmp_path / "data.mdb")
    try:
        kept = store.read(key(4096 * 3 - 15), lambda v: v, waiting)
        assert store.read(key(5 << 20), bytes, waiting) == value(5 << 20, 5 << 20)
        assert bytes(kept) == value(4096 * 3 - 15, 4096 * 3 - 15)
    finally:
        store.close()


def test_a_large_value_is_read_at_its_place_without_the_map(store: DiskStore, tmp_path: Path) -> None:
    """A large value is read from the file where it lies, not through LMDB's get (which would read every page
    of it through the map): read cold with direct I/O, none of its pages enter the page cache; read without
    `waiting` (a lone restore), through the page cache."""
    if _open_direct(str(tmp_path / "data.mdb")) < 0:
        pytest.skip("the file system under the test's directory has no direct I/O")
    assert store.put_many([(key(1), value(1, 4 << 20))])
    store.close()
    reopened = DiskStore(tmp_path, map_size=MAP_SIZE)
    try:
        _drop_page_cache(tmp_path / "data.mdb")  # what the open read ahead goes (its tree pages stay)
        before = _resident_bytes(tmp_path / "data.mdb")
        if before >= 1 << 20:
            pytest.skip("the file system keeps the file's pages (no page cache to drop)")
        assert reopened.read(key(1), bytes, nullcontext) == value(1, 4 << 20)
        assert _resident_bytes(tmp_path / "data.mdb") - before < 1 << 20
        assert reopened.get_many([key(1)]) == [value(1, 4 << 20)]
        assert _resident_bytes(tmp_path / "data.mdb") - before >= 3 << 20  # a few of its pages were in
    finally:
        reopened.close()


def test_a_place_that_is_not_its_value_costs_a_read_through_the_map_never_bytes(store: DiskStore,
                                                                                tmp_path: Path) -> None:
    """A place record pointing at another value of the same size, at pages that are no value's start, or of a
    damaged size, and a value stored before places were kept (none): each read gives the value's own bytes.
    Deleting a value deletes its place; putting a key again moves it."""
    n = 3 * 4096
    assert store.put_many([(key(i), value(i, n)) for i in range(4)])
    store.close()
    env = lmdb.open(str(tmp_path), map_size=MAP_SIZE, max_dbs=5)
    with env.begin(write=True) as txn:
        places = env.open_db(b"places", txn=txn)
        assert txn.stat(places)["entries"] == 4
        other = ValuePlace.unpack(txn.get(key(1), db=places))
        txn.put(key(0), other.pack(), db=places)  # another key's value: its hash is of that key
        txn.put(key(1), ValuePlace(other.page + 1, other.length, other.ends).pack(), db=places)  # inside a run
        txn.put(key(2), b"\x00" * 5, db=places)  # a damaged record
        txn.delete(key(3), db=places)  # as written before places were kept
    env.close()
    reopened = DiskStore(tmp_path, map_size=MAP_SIZE)
    try:
        for i in range(4):
            assert reopened.read(key(i), bytes, nullcontext) == value(i, n), i
            assert reopened.read(key(i), bytes) == value(i, n), i
        assert reopened.get_many([key(i) for i in range(4)]) == [value(i, n) for i in range(4)]
        assert reopened.put_many([(key(3), value(30, n))])  # a value put again has a place again
        assert reopened.delete_many([key(2)]) == 1
        assert reopened.read(key(3), bytes, nullcontext) == value(30, n)
    finally:
        reopened.close()
    env = lmdb.open(str(tmp_path), map_size=MAP_SIZE, max_dbs=5)
    with env.begin() as txn:
        places = env.open_db(b"places", txn=txn, create=False)
        assert txn.get(key(2), db=places) is None
        assert ValuePlace.unpack(txn.get(key(3), db=places)).length == n
    env.close()


def test_a_lookup_reads_the_tree_not_the_values_around_it(tmp_path: Path) -> None:
    """The map is opened without readahead: looking keys up faults in the tree's pages only, not megabytes of
    the values around them (a lookup's fault that read ahead cost each prompt looked up 3-4 ms of CPU)."""
    store = DiskStore(tmp_path, map_size=256 << 20)
    for i in range(8):
        assert store.put_many([(key(i), value(i, 4 << 20))])
    store.close()
    reopened = DiskStore(tmp_path, map_size=256 << 20)
    try:
        _drop_page_cache(tmp_path / "data.mdb")
        before = _resident_bytes(tmp_path / "data.mdb")
        if before >= 1 << 20:
            pytest.skip("the file system keeps the file's pages (no page cache to drop)")
        assert reopened.contains_each([key(i) for i in range(8)]) == [True] * 8
        assert _resident_bytes(tmp_path / "data.mdb") - before < 256 << 10
    finally:
        reopened.close()


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # pages no process maps
    finally:
        os.close(fd)


def _resident_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (mincore over a map of it of our own)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        libc = ctypes.CDLL(None, use_errno=True)
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        address = ctypes.c_void_p(np.frombuffer(m, np.uint8).ctypes.data)
        assert libc.mincore(address, ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec) * mmap.PAGESIZE


def test_a_key_given_twice_in_a_batch_keeps_its_last_value(store: DiskStore) -> None:
    assert store.put_many([(key(1), b"first"), (key(1), b"second")])
    assert store.get_many([key(1)]) == [b"second"]
    assert store.put_many([(key(1), b"third")])
    assert store.get_many([key(1)]) == [b"third"]
    assert store.stats().num_entries == 1


def test_cataloged_marks_live_and_die_with_their_values(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    assert store.put_many([(key(1), value(1)), (key(2), value(2))], cataloged=True)
    assert store.put_many([(key(3), value(3))])  # plain cache: never marked
    assert sorted(store.cataloged_keys()) == [key(1), key(2)]
    assert store.delete_many([key(1)]) == 1
    store.close()
    again = DiskStore(tmp_path, map_size=MAP_SIZE)
    assert again.cataloged_keys() == [key(2)]
    for i in range(4, 40):  # fill the map: the LRU takes key 2 and its mark with it
        assert again.put_many([(key(i), value(i, 1 << 20))])
    assert again.contains_prefix([key(2)]) == 0 and again.cataloged_keys() == []
    again.close()


def test_values_survive_close_and_reopen(tmp_path: Path) -> None:
    first = DiskStore(tmp_path, map_size=MAP_SIZE)
    first.put_many([(key(i), value(i)) for i in range(10)])
    first.close()
    again = DiskStore(tmp_path, map_size=MAP_SIZE)
    assert again.get_many([key(i) for i in range(10)]) == [value(i) for i in range(10)]
    assert again.stats().num_entries == 10
    again.close()


def test_a_bad_key_is_the_callers_bug_and_leaves_the_store_healthy(store: DiskStore) -> None:
    with pytest.raises(ValueError, match="1 to 511 bytes"):
        store.put_many([(b"", b"x")])
    with pytest.raises(ValueError):
        store.get_many([bytes(512)])
    assert store.stats().healthy


# -- a full map evicts ---------------------------------------------------------------------


def test_a_tiny_map_evicts_the_least_recently_used_and_never_fails(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=1 << 20)
    for i in range(40):
        assert store.put_many([(key(i), value(i, 64 << 10))])
        store.get_many([key(0)])  # key 0 stays in use
    stats = store.stats()
    assert stats.num_evictions > 0 and stats.num_rejected == 0 and stats.healthy
    assert 0 < stats.num_entries < 40
    assert stats.bytes_used <= stats.capacity_bytes
    newest = [key(i) for i in range(35, 40)]
    assert store.get_many(newest) == [value(i, 64 << 10) for i in range(35, 40)]
    assert store.get_many([key(0), key(1)]) == [value(0, 64 << 10), None]
    store.close()


def test_pinned_values_survive_a_tiny_map_until_unpinned(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=1 << 20)
    for i in range(3):
        assert store.put_many([(key(i), value(i, 64 << 10))])
    assert store.pin([key(0), key(1), key(99)]) == 2  # 99 is not there
    for i in range(3, 40):  # never read again: plain LRU would drop 0 and 1 first
        assert store.put_many([(key(i), value(i, 64 << 10))])
    assert store.stats().num_evictions > 0
    assert store.get_many([key(0), key(1), key(2)]) == [value(0, 64 << 10), value(1, 64 << 10), None]
    store.unpin([key(0)])
    for i in range(40, 80):
        assert store.put_many([(key(i), value(i, 64 << 10))])
    assert store.get_many([key(0), key(1)]) == [None, value(1, 64 << 10)]
    store.close()


def test_the_lru_order_survives_reopen(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=1 << 20)
    for i in range(4):
        store.put_many([(key(i), value(i, 64 << 10))])
    store.get_many([key(0)])  # now 1 is the least recently used
    store.close()
    store = DiskStore(tmp_path, map_size=1 << 20)
    vanished_at: dict[int, int] = {}
    i = 4
    while len(vanished_at) < 4:
        store.put_many([(key(i), value(i, 64 << 10))])
        for k in range(4):
            if k not in vanished_at and not store.contains_prefix([key(k)]):
                vanished_at[k] = i
        i += 1
    assert vanished_at[1] <= vanished_at[2] <= vanished_at[3] <= vanished_at[0]
    assert vanished_at[1] < vanished_at[0]  # in put order, 0 would have gone first
    store.close()


def test_a_batch_that_can_never_fit_is_refused_without_evicting(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=1 << 20)
    assert store.put_many([(key(0), value(0))])
    assert not store.put_many([(key(i), value(i, 64 << 10)) for i in range(1, 9)])
    assert store.get_many([key(0), key(1)]) == [value(0), None]
    assert store.stats().num_rejected == 1 and store.stats().num_evictions == 0
    store.close()


def test_threads_share_one_store(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=4 << 20)  # small enough to evict while others read

    def work(t: int) -> None:
        for i in range(t * 100 + 1, t * 100 + 61):
            assert store.put_many([(key(i), value(i, 20_000))])
            got = store.get_many([key(i), key(i - 1)])
            assert got[0] == value(i, 20_000)
            assert got[1] in (None, value(i - 1, 20_000))

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    assert store.stats().healthy and store.stats().num_evictions > 0
    store.close()


# -- kill -9 -------------------------------------------------------------------------------


def test_kill_9_mid_write_leaves_whole_batches_and_whole_values(tmp_path: Path) -> None:
    """A writer is killed mid-run, three times over: each batch is all there or all gone, in commit order."""
    writer = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from chunk_fixtures import write_batches_forever; write_batches_forever(sys.argv[2], int(sys.argv[3]))"
    )
    rounds = [(0, 0.05), (100_000, 0.2), (200_000, 0.4)]  # (first batch, seconds to run after "ready")
    for first_batch, run_s in rounds:
        child = subprocess.Popen(
            [sys.executable, "-c", writer, str(TESTS), str(tmp_path), str(first_batch)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(run_s)
        child.send_signal(signal.SIGKILL)
        child.wait()

    store = DiskStore(tmp_path, map_size=1 << 30)
    for first_batch, _ in rounds:
        committed = first_batch
        while (present := count_present(store, committed)) == CRASH_BATCH:
            committed += 1
        assert present == 0, f"batch {committed} is torn: {present} of {CRASH_BATCH} chunks"
        assert committed - first_batch > 20  # every batch before "ready", and then some
        for later in range(committed, committed + 50):
            assert count_present(store, later) == 0, f"batch {later} committed after missing batch {committed}"
        for batch in range(first_batch, committed):
            for i in range(CRASH_BATCH):
                k, identity, _ = crash_chunk(batch, i)
                (frame,) = store.get_many([k])
                decode_frame(frame, identity)  # checksum, hashes and tokens all hold
    assert store.stats().healthy
    store.close()


def count_present(store: DiskStore, batch: int) -> int:
    keys = [crash_chunk(batch, i)[0] for i in range(CRASH_BATCH)]
    return sum(v is not None for v in store.get_many(keys))


# -- refusals at open ----------------------------------------------------------------------


def test_a_missing_directory_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailableError, match="No such file or directory"):
        DiskStore(tmp_path / "nowhere", map_size=MAP_SIZE)


def test_a_path_under_a_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreUnavailableError, match="Not a directory"):
        DiskStore(tmp_path / "file" / "kv", map_size=MAP_SIZE)


def test_a_read_only_directory_is_unavailable(tmp_path: Path) -> None:
    """Opened by a child without the capability that lets root write anywhere, so the mode decides."""
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    opener = (
        "import sys\n"
        "from kvtierd.storage.disk_store import DiskStore\n"
        "from kvtierd.storage.store_errors import StoreUnavailableError\n"
        "try:\n"
        "    DiskStore(sys.argv[1], map_size=1 << 20)\n"
        "except StoreUnavailableError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    drop_root = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    result = subprocess.run(
        [*drop_root, sys.executable, "-c", opener, str(read_only)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 3, result.stderr
    assert "Permission denied" in result.stdout
    assert not (read_only / "data.mdb").exists()


def test_a_garbage_data_file_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "data.mdb").write_bytes(np.random.default_rng(7).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes())
    with pytest.raises(StoreUnavailableError, match="not an LMDB file"):
        DiskStore(tmp_path, map_size=MAP_SIZE)


def test_a_data_file_with_smashed_meta_pages_is_unavailable(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    store.put_many([(key(i), value(i)) for i in range(20)])
    store.close()
    with open(tmp_path / "data.mdb", "r+b") as f:
        f.write(b"\xa5" * (2 * 4096))  # both meta pages
    with pytest.raises(StoreUnavailableError):
        DiskStore(tmp_path, map_size=MAP_SIZE)


def test_a_closed_store_is_unavailable(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.get_many([key(0)])
    assert store.stats().healthy is False


# -- quarantine ----------------------------------------------------------------------------


def test_a_value_that_fails_its_checks_is_quarantined_and_counted(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    identity = make_identity(pages=2)
    frame = bytearray(encode_frame(identity, make_payload(identity)))
    frame[-1] ^= 0x01  # a bit flipped in the payload on disk
    chunk_key = identity.block_hashes[-1]
    store.put_many([(chunk_key, bytes(frame))])

    (stored,) = store.get_many([chunk_key])
    with pytest.raises(CorruptValueError) as caught:
        decode_frame(stored, identity)
    assert store.quarantine(chunk_key, str(caught.value))

    assert store.get_many([chunk_key]) == [None]
    assert store.contains_prefix([chunk_key]) == 0
    stats = store.stats()
    assert (stats.num_entries, stats.num_corrupt, stats.num_quarantined) == (0, 1, 1)
    assert not store.quarantine(chunk_key, "reported twice")  # nothing left to move: one bad value, counted once
    assert store.stats().num_corrupt == 1
    store.close()

    reopened = DiskStore(tmp_path, map_size=MAP_SIZE)
    assert reopened.stats().num_quarantined == 1
    assert reopened.get_many([chunk_key]) == [None]
    reopened.close()


def test_the_quarantine_keeps_only_the_newest_bad_values(store: DiskStore) -> None:
    n = MAX_QUARANTINED + 3
    store.put_many([(key(i), value(i)) for i in range(n)])
    for i in range(n):
        assert store.quarantine(key(i), "checksum")
    stats = store.stats()
    assert (stats.num_entries, stats.num_corrupt, stats.num_quarantined) == (0, n, MAX_QUARANTINED)
