"""The LMDB disk tier, on real LMDB files: batches, LRU eviction, crash safety, refusals, quarantine."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from chunk_fixtures import CRASH_BATCH, crash_chunk, make_identity, make_payload

from kvtierd.storage.disk_store import MAX_QUARANTINED, DiskStore
from kvtierd.storage.kv_frame import decode_frame, encode_frame
from kvtierd.storage.map_reader import _open_direct
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


def test_a_large_value_is_read_with_direct_io_outside_the_callers_slice(store: DiskStore, tmp_path: Path) -> None:
    """A paced load's read of a large value goes straight from the disk (no page cache), with the caller's `waiting`
    around it; a small one (inside a leaf page), or one read without `waiting`, is copied as before. Same bytes either
    way, on a fresh store and after reopening it, at sizes that fill their last page exactly or not."""
    if _open_direct(str(tmp_path / "data.mdb")) < 0:
        pytest.skip("the file system under the test's directory has no direct I/O")
    sizes = [100, 1000, 3000, 4096 - 16, 4096 * 3 - 16, 4096 * 3 - 15, 5 << 20]
    assert store.put_many([(key(n), value(n, n)) for n in sizes])
    waits: list[int] = []

    @contextmanager
    def waiting() -> Iterator[None]:
        waits.append(1)
        yield

    for n in sizes:
        waits.clear()
        assert store.read(key(n), bytes, waiting) == value(n, n)
        assert len(waits) == (n > 2048), n  # a value in overflow pages (past half a page) is read with direct I/O
        # ... and the bytes used are that read's, in its page-aligned buffer (not a fallback's copy)
        assert store.read(key(n), lambda v: isinstance(v.obj, mmap.mmap), waiting) == (n > 2048)
    assert store.read(key(1), bytes, waiting) is None
    # A view a caller still holds survives a larger read that needs a larger buffer.
    store.close()
    store = DiskStore(tmp_path, map_size=MAP_SIZE)
    kept = store.read(key(3000), lambda v: v, waiting)
    assert store.read(key(5 << 20), bytes, waiting) == value(5 << 20, 5 << 20)
    assert bytes(kept) == value(3000, 3000)
    # A read in one piece (no `waiting`) goes through the page cache.
    assert store.read(key(5 << 20), lambda v: (bytes(v), isinstance(v.obj, mmap.mmap))) == \
        (value(5 << 20, 5 << 20), False)
    store.close()
    reopened = DiskStore(tmp_path, map_size=MAP_SIZE)
    try:
        assert reopened.read(key(5 << 20), bytes, waiting) == value(5 << 20, 5 << 20)
    finally:
        reopened.close()


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
