"""The disk tier: chunk values in one LMDB environment under a directory.

Five sub-databases:

    values      key -> value (a kv_frame; opaque here)
    order       key -> <Q use sequence, Q charged bytes> + owner: the LRU order, read into memory at open;
                the owner is the tenant namespace that stored the value (a record written before
                owners were kept ends after the two numbers: the value is unowned, the owner b"")
    cataloged   key -> b"": values a session's turn wrote, which the SQL catalog names (written in
                the value's transaction, deleted with it), so a value the catalog has lost is
                found and removed at startup
    quarantine  key -> <Q time_ns, H reason length> + reason + the bad value
    places      key -> <Q first page, Q length, Q hash of key and ends>: where a large value lies in data.mdb,
                written and deleted with it (`storage/value_places.py`); a read goes to the file there,
                and a value without one (written before places were kept) is read through LMDB's get

Every batch is one write transaction, synced at commit: a batch is wholly there
or wholly absent after kill -9 or a power cut, and a value is never torn.

The LRU lives in memory (an OrderedDict rebuilt from `order` at open). A read
gives its keys new use sequences in memory only; they reach `order` with the
next write transaction (or at close), so a read never pays for an fsync.

Room: before a batch of `need` bytes is written, LRU values (pinned ones passed
over) are evicted until

    live pages + 2 * need + slack <= map size

where live pages are what LMDB's trees hold now (exact, from its stats). Twice
the batch, because LMDB keeps the previous snapshot intact: the pages that the
eviction just freed become reusable only one transaction later. The slack is
for the copied tree pages of a write and the free list's own pages. Should that
still fall short (MapFullError), more values go and the write is retried: a
full map means eviction, never an error to the caller. Only a map so jammed
that even deletes fail makes the store unavailable.

Owners: with shares (`share_by`), eviction takes from the owner with the most
bytes per unit of weight, its least recently used value first, so a tenant's
flood evicts its own values before another tenant's (`storage/owner_shares.py`).
With a limit (`limit_by`), an owner past its bytes first evicts its own least
recently used values; a batch that its pinned values leave no room for is
refused (counted), nothing of anyone else's is touched.

Threads: any thread may call any method (the tier manager uses a pool). Writers
are serialized by `_write_lock` (LMDB serializes them anyway); `_lock` guards
the in-memory LRU and counters and is never held across I/O. Open the store
after forking, never before: an LMDB environment does not survive fork; and
open a directory once per process (LMDB's rule).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb

from kvtierd.storage.chunk_store import StoreStats
from kvtierd.storage.owner_shares import OwnerUsage, by_standing
from kvtierd.storage.store_errors import StoreUnavailableError
from kvtierd.storage.value_places import PlaceReader, ValuePlace, Waiting, place_of

# Kept free: map_size // SLACK_RATIO, between MIN_SLACK_PAGES (each write copies a few tree
# pages per sub-database, and the freed ones stay pinned for a transaction) and MAX_SLACK.
SLACK_RATIO = 16
MIN_SLACK_PAGES = 64
MAX_SLACK = 256 << 20
T = TypeVar("T")
ENTRY_OVERHEAD = 64  # a leaf node's header and key, plus the order record's numbers, per value (roughly)
MAX_QUARANTINED = 16  # the newest bad values kept for inspection; older ones are dropped
MAX_WRITE_ATTEMPTS = 4
READ_TXN_SPARES = 8  # read transactions LMDB keeps for reuse: about the tier manager's thread count

_ORDER = struct.Struct("<QQ")
_QUARANTINE_HEADER = struct.Struct("<QH")


@dataclass(slots=True)
class _Entry:
    seq: int  # use sequence: larger is more recent
    charge: int  # about the bytes the value takes in the map: what evicting it frees
    owner: bytes = b""  # the tenant namespace that stored it; b"": unknown (shared)

    def record(self) -> bytes:
        return _ORDER.pack(self.seq, self.charge) + self.owner


class DiskStore:
    """A ChunkStore on LMDB. Raises StoreUnavailableError at open, or once LMDB itself fails."""

    def __init__(self, path: str | os.PathLike[str], *, map_size: int) -> None:
        self.path = Path(path)
        try:
            self._env = lmdb.open(
                str(self.path),
                # `path` is a directory holding data.mdb and lock.mdb.
                subdir=True,
                # The directory must exist: the daemon makes its state directory with its own
                # owner and mode, and a missing one is a misconfiguration to report, not to paper over.
                create=False,
                # The file's upper bound. It grows sparsely, so a large map costs no disk until used;
                # an existing file larger than this keeps its size.
                map_size=map_size,
                max_dbs=5,  # values, order, cataloged, quarantine, places
                # No readahead on the map: values are read at their place (value_places.py), so the map
                # serves B-tree pages, and a lookup's fault that read ahead (8 MiB on a virtual disk) took
                # 3-4 ms of CPU beside the steps for each prompt looked up and brought in parts of values
                # (probe, `bench stall`). A value without a place (written before places were kept) is read
                # through the map, a page fault per 4 KiB (about 30x slower cold than with readahead).
                readahead=False,
                # Pages are written with write(), not through a writable map: slower, but a stray
                # write into the map cannot corrupt the file, and the file grows with its data
                # instead of being sized to the whole map at open.
                writemap=False,
                # fsync data and meta page at every commit: a committed batch survives a power cut too,
                # at the cost of one fsync per batch (batches are large, so that is cheap per byte).
                # With sync=False a power cut could lose the last commits or corrupt the file.
                sync=True,
                metasync=True,
                # The lock file lets readers and the one writer share the file, across processes too.
                lock=True,
                max_spare_txns=READ_TXN_SPARES,
            )
        except lmdb.Error as e:
            raise StoreUnavailableError(f"disk KV store {self.path}: {e}") from e
        self._check_file_size()
        try:
            # Reader slots left by a killed process would pin old pages and keep the map from reusing them.
            self._env.reader_check()
            self._psize = self._env.stat()["psize"]
            self._max_key = self._env.max_key_size()
            with self._env.begin(write=True) as txn:
                self._values = self._env.open_db(b"values", txn=txn)
                self._order = self._env.open_db(b"order", txn=txn)
                self._cataloged = self._env.open_db(b"cataloged", txn=txn)
                self._quarantine = self._env.open_db(b"quarantine", txn=txn)
                self._places = self._env.open_db(b"places", txn=txn)
            with self._env.begin() as txn:
                self._lru = _read_lru(txn, self._order)
            self._owned: Counter[bytes] = Counter()  # bytes (charges) per owner
            for entry in self._lru.values():
                self._owned[entry.owner] += entry.charge
            self._lock = threading.Lock()
            self._measure()
        except (lmdb.Error, struct.error) as e:  # struct.error: an LRU record of the wrong size (a damaged page)
            self._env.close()
            raise StoreUnavailableError(f"disk KV store {self.path} is unreadable: {e}") from e
        self._map_bytes = self._env.info()["map_size"]
        self._slack = max(MIN_SLACK_PAGES * self._psize, min(self._map_bytes // SLACK_RATIO, MAX_SLACK))
        self._next_seq = max((e.seq for e in self._lru.values()), default=0) + 1
        self._touched: set[bytes] = set()  # read since their sequence was last written
        self._pinned: set[bytes] = set()  # never evicted (pins live in SQL; the tier manager pins again at startup)
        self._weight: Callable[[bytes], float] | None = None  # an owner's weight; None: one LRU for all
        self._cap: Callable[[bytes], int | None] = lambda owner: None  # bytes an owner may hold (None: any)
        self._over_limit: Counter[bytes] = Counter()  # batches refused at their owner's limit
        self._write_lock = threading.Lock()
        self._failure: str | None = None
        self._num_puts = self._num_gets = self._num_hits = 0
        self._num_evictions = self._num_rejected = self._num_corrupt = 0
        self._reader = PlaceReader(self.path / "data.mdb", self._psize)

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        self._check_keys(keys)
        with self._guard(), self._env.begin() as txn:
            cursor = txn.cursor(db=self._values)
            for n, key in enumerate(keys):
                if not cursor.set_key(key):  # positions only: the value is not copied
                    return n
            return len(keys)

    def contains_each(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_keys(keys)
        with self._guard(), self._env.begin() as txn:
            cursor = txn.cursor(db=self._values)
            return [cursor.set_key(key) for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """The values, each a writable view of a buffer of its own."""
        self._check_keys(keys)
        with self._guard(), self._env.begin(buffers=True) as txn:
            values = [self._value(txn, key, own=True) for key in keys]
        self._touch(keys, values)
        return values

    def read(self, key: bytes, use: Callable[[memoryview], T], waiting: Waiting | None = None) -> T | None:
        """`use(value)` with the value in this thread's scratch buffer (writable, reused: a load decodes or
        copies straight from it into the device, with no buffer allocated per value); do not keep the
        buffer. None on a miss. Given `waiting`, a large value the page cache does not hold is read with direct
        I/O, `waiting()` around the read (`PlaceReader.read`)."""
        self._check_keys([key])
        with self._guard(), self._env.begin(buffers=True) as txn:
            value = self._value(txn, key, waiting)
        self._touch([key], [value])
        return None if value is None else use(value)

    def _value(self, txn: lmdb.Transaction, key: bytes, waiting: Waiting | None = None,
               own: bool = False) -> memoryview | None:
        """The value in this thread's scratch buffer (with `own`, in one of its own), read from the file at its
        place, or through LMDB's get (which reads its pages through the map) when it has none or what lies
        there is not it."""
        record = txn.get(key, db=self._places)
        place = ValuePlace.unpack(record) if record is not None else None
        value = self._reader.read(key, place, waiting, own) if place is not None else None
        if value is None and (view := txn.get(key, db=self._values)) is not None:
            value = self._reader.copy(view, own)
        return value

    def _touch(self, keys: Sequence[bytes], values: Sequence[object | None]) -> None:
        """Counts a read, and moves the values found to the LRU's recent end."""
        with self._lock:
            self._num_gets += len(keys)
            for key, value in zip(keys, values, strict=True):
                entry = self._lru.get(key) if value is not None else None
                if entry is not None:
                    self._num_hits += 1
                    self._lru.move_to_end(key)
                    entry.seq = self._next_seq
                    self._next_seq += 1
                    self._touched.add(key)

    def put_many(self, items: Sequence[tuple[bytes, bytes]], cataloged: bool = False, owner: bytes = b"") -> bool:
        """With `cataloged`, the keys are also marked as named by the SQL catalog (see `cataloged_keys`).
        `owner`: the tenant namespace the values belong to (shares and limits; b"": none)."""
        batch = dict(items)  # a key given twice keeps its last value
        self._check_keys(batch)
        if not batch:
            return True
        charges = {key: self._charge(len(value) + len(owner)) for key, value in batch.items()}
        need = sum(charges.values())
        with self._guard(), self._write_lock:
            if (2 * need + self._slack > self._map_bytes or not self._fit_limit(owner, need, batch)
                    or not self._make_room(need)):
                with self._lock:
                    self._num_rejected += 1
                return False
            with self._lock:
                entries = {key: _Entry(self._next_seq + i, charges[key], owner) for i, key in enumerate(batch)}
                self._next_seq += len(batch)

            def write(txn: lmdb.Transaction) -> None:
                for key, value in batch.items():
                    txn.put(key, value, db=self._values)
                    place = place_of(key, txn.get(key, db=self._values), self._psize)  # its pages are in memory
                    if place is not None:
                        txn.put(key, place.pack(), db=self._places)
                    else:
                        txn.delete(key, db=self._places)  # a value it replaced had one
                    txn.put(key, entries[key].record(), db=self._order)
                    if cataloged:
                        txn.put(key, b"", db=self._cataloged)

            stored = self._write(write, need)
            with self._lock:
                if not stored:
                    self._num_rejected += 1
                    return False
                for key, entry in entries.items():
                    self._unlist(key)  # a replaced value moves to the most recent end
                    self._lru[key] = entry
                    self._owned[owner] += entry.charge
                    self._touched.discard(key)
                self._num_puts += len(batch)
            return True

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._check_keys(keys)
        with self._guard(), self._write_lock:
            deleted: list[bytes] = []

            def write(txn: lmdb.Transaction) -> None:
                deleted[:] = [key for key in keys if self._delete_value(txn, key)]

            self._write(write)
            self._forget(deleted)
            return len(deleted)

    def pin(self, keys: Sequence[bytes]) -> int:
        """Keeps these values out of eviction until unpinned (deletes still remove them); returns how many
        were there to pin."""
        with self._lock:
            present = [key for key in keys if key in self._lru]
            self._pinned.update(present)
            return len(present)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pinned.difference_update(keys)

    def share_by(self, weight: Callable[[bytes], float]) -> None:
        """A full store evicts from the owner with the most bytes per unit of `weight(owner)` first."""
        self._weight = weight

    def limit_by(self, cap_bytes: Callable[[bytes], int | None]) -> None:
        """An owner may hold at most `cap_bytes(owner)` bytes of values (None: no limit)."""
        self._cap = cap_bytes

    def usage_by_owner(self) -> dict[bytes, OwnerUsage]:
        with self._lock:
            entries = Counter(entry.owner for entry in self._lru.values())
            return {owner: OwnerUsage(entries[owner], self._owned[owner], self._over_limit[owner])
                    for owner in {*entries, *self._over_limit}}

    def quarantine(self, key: bytes, reason: str) -> bool:
        """Moves a value that failed its checks out of `values`, keeping it and the reason for inspection.

        Counted as corrupt if it was still there: two readers that found the same bad value (the prefetch
        thread and the engine's) count it once. Returns whether it was there to move.
        """
        self._check_keys([key])
        record = _QUARANTINE_HEADER.pack(time.time_ns(), len(reason.encode())) + reason.encode()
        with self._guard(), self._write_lock:
            with self._lock:
                # Out of the LRU first, so that making room for the record cannot pick it.
                entry = self._unlist(key)
                self._touched.discard(key)
                if entry is not None:
                    self._num_corrupt += 1
            if entry is None:
                return False

            def move(txn: lmdb.Transaction) -> None:
                value = txn.get(key, db=self._values)
                if value is not None:
                    self._delete_value(txn, key)
                    txn.put(key, record + value, db=self._quarantine)
                    _drop_oldest_quarantined(txn, self._quarantine)

            if not self._write(move):
                # No room even for the record: the bad value must still never be served again.
                self._write(lambda txn: self._delete_value(txn, key))
            return True

    def cataloged_keys(self) -> list[bytes]:
        """The keys of the values written with `cataloged` that are still here."""
        with self._guard(), self._env.begin() as txn:
            return [bytes(key) for key, _ in txn.cursor(db=self._cataloged)]

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                num_entries=len(self._lru),
                bytes_used=self._live_bytes,
                capacity_bytes=self._map_bytes,
                num_puts=self._num_puts,
                num_gets=self._num_gets,
                num_hits=self._num_hits,
                num_evictions=self._num_evictions,
                num_rejected=self._num_rejected,
                num_corrupt=self._num_corrupt,
                num_quarantined=self._num_quarantined,
                healthy=self._failure is None,
                reason=self._failure,
            )

    def close(self) -> None:
        """Saves the LRU positions of values read since the last write, then closes the environment."""
        if self._failure is None:
            with self._guard(), self._write_lock:
                if self._touched:
                    self._write(lambda txn: None)
        self._failure = "closed"
        self._env.close()
        self._reader.close()

    # -- room ---------------------------------------------------------------------------------

    def _charge(self, nbytes: int) -> int:
        """About the map bytes a value takes: small ones share leaf pages (half full at worst),
        larger ones take whole overflow pages of their own."""
        if nbytes + ENTRY_OVERHEAD <= self._psize // 2:
            return 2 * (nbytes + ENTRY_OVERHEAD)
        return -(-(nbytes + ENTRY_OVERHEAD) // self._psize) * self._psize

    def _make_room(self, need: int) -> bool:
        """Evicts LRU values until a batch of `need` bytes fits (see the module's note on room)."""
        while (excess := self._live_bytes + 2 * need + self._slack - self._map_bytes) > 0:
            if not self._evict(excess):
                return False
        return True

    def _fit_limit(self, owner: bytes, need: int, batch: Collection[bytes]) -> bool:
        """Evicts the owner's own least recently used values until `need` more bytes (the batch's) fit under
        its limit; False, evicting nothing, when its pinned values leave no room for them."""
        cap = self._cap(owner)
        while cap is not None:
            with self._lock:
                # The batch's keys are being rewritten: their old values count neither way.
                mine = [(key, e.charge) for key, e in self._lru.items() if e.owner == owner and key not in batch]
                held = sum(charge for _, charge in mine)
                kept = sum(charge for key, charge in mine if key in self._pinned)
                if kept + need > cap:
                    self._over_limit[owner] += 1
                    return False
            if held + need <= cap:
                break
            if not self._evict(held + need - cap, owner, spare=batch):  # not while `held` is more than `kept`
                return False
        return True

    def _evict(self, nbytes: int, owner: bytes | None = None, spare: Collection[bytes] = ()) -> bool:
        """Drops values worth at least `nbytes` (or all that may go), pinned ones and `spare` passed over:
        `owner`'s least recently used when given, else by shares (see `share_by`) or least recently used.
        False if there was none."""
        with self._lock:
            victims = self._victims(nbytes, owner, spare)
        if not victims:
            return False
        # A MapFullError here (not even a delete finds a free page) escapes to _guard: the store is jammed.
        with self._env.begin(write=True) as txn:
            for key in victims:
                self._delete_value(txn, key)
        self._measure()
        self._forget(victims)
        with self._lock:
            self._num_evictions += len(victims)
        return True

    def _victims(self, nbytes: int, owner: bytes | None, spare: Collection[bytes]) -> list[bytes]:
        """The keys `_evict` drops. Caller holds `_lock`."""

        def oldest(of: bytes | None) -> Iterator[bytes]:
            return (key for key, e in self._lru.items()
                    if (of is None or e.owner == of) and key not in self._pinned and key not in spare)

        victims, freed = [], 0
        if owner is not None or self._weight is None:
            for key in oldest(owner):
                if freed >= nbytes:
                    break
                victims.append(key)
                freed += self._lru[key].charge
            return victims
        # Shares: each value from the owner standing highest as the values already chosen leave it.
        held = Counter(self._owned)
        queues: dict[bytes, Iterator[bytes]] = {}
        while freed < nbytes:
            for victim_owner in by_standing(held, self._weight):
                key = next(queues.setdefault(victim_owner, oldest(victim_owner)), None)
                if key is not None:
                    break
                del held[victim_owner]  # nothing of its may go
            else:
                break
            victims.append(key)
            freed += self._lru[key].charge
            held[victim_owner] -= self._lru[key].charge
        return victims

    def _write(self, body: Callable[[lmdb.Transaction], object], need: int = 0) -> bool:
        """Runs `body` (writing about `need` bytes) in one write transaction; on a full map evicts
        more and retries. False if it never fit.

        The transaction also saves the use sequences of values read since the last write.
        `body` may run more than once, so it reads the in-memory state but never changes it.
        """
        for _ in range(MAX_WRITE_ATTEMPTS):
            with self._lock:
                touched = {key: e.record() for key in self._touched if (e := self._lru.get(key))}
            try:
                # buffers=True: reads inside a write are views of the map, valid until commit;
                # a body copies what it keeps.
                with self._env.begin(write=True, buffers=True) as txn:
                    for key, record in touched.items():
                        txn.put(key, record, db=self._order)
                    body(txn)
            except lmdb.MapFullError:
                # Tree pages, a free list too fragmented for a long overflow run, or pages a reader
                # still holds took more than the headroom: free some more and try again.
                if not self._evict(max(need, self._slack)):
                    return False
                continue
            self._measure()
            with self._lock:
                # A key read again meanwhile has a newer sequence, still to save.
                self._touched -= {
                    key for key, record in touched.items() if key not in self._lru or self._lru[key].record() == record
                }
            return True
        return False

    def _delete_value(self, txn: lmdb.Transaction, key: bytes) -> bool:
        txn.delete(key, db=self._order)
        txn.delete(key, db=self._cataloged)
        txn.delete(key, db=self._places)
        return txn.delete(key, db=self._values)

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._unlist(key)
                self._touched.discard(key)
                self._pinned.discard(key)

    def _unlist(self, key: bytes) -> _Entry | None:
        """Takes a key out of the LRU and its owner's bytes. Caller holds `_lock`."""
        entry = self._lru.pop(key, None)
        if entry is not None:
            self._owned[entry.owner] -= entry.charge
            if not self._owned[entry.owner]:
                del self._owned[entry.owner]
        return entry

    def _measure(self) -> None:
        """Reads the pages LMDB's trees hold now (the free list's own pages are in the slack)."""
        with self._env.begin() as txn:
            stats = [txn.stat(db) for db in (self._values, self._order, self._cataloged, self._quarantine,
                                             self._places)]
        stats.append(self._env.stat())  # the main tree, which names the sub-databases
        live = sum(st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] for st in stats) * self._psize
        with self._lock:
            self._live_bytes = live
            self._num_quarantined = stats[3]["entries"]

    # -- errors -------------------------------------------------------------------------------

    def _check_file_size(self) -> None:
        """Refuses a data.mdb shorter than the pages its meta page names (a truncated copy or restore).

        LMDB trusts the meta page: its first read of a page past the file's end would kill the
        process with SIGBUS, not raise. Only the meta pages have been read at this point.
        """
        needed = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        size = (self.path / "data.mdb").stat().st_size
        if size < needed:
            self._env.close()
            raise StoreUnavailableError(
                f"disk KV store {self.path} is truncated: data.mdb has {size} bytes, its pages need {needed}")

    def _check_keys(self, keys: Iterable[bytes]) -> None:
        # A bad key is the caller's bug; letting LMDB reject it would look like a failing disk.
        for key in keys:
            if not 0 < len(key) <= self._max_key:
                raise ValueError(f"a key must have 1 to {self._max_key} bytes, got {len(key)}")

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turns LMDB's errors (a failing disk, a corrupted page) into StoreUnavailableError, and keeps it so."""
        if self._failure is not None:
            raise StoreUnavailableError(f"disk KV store {self.path} is unavailable: {self._failure}")
        try:
            yield
        except lmdb.Error as e:
            note = self._full_note()
            self._failure = f"{type(e).__name__}: {e}{note}"
            raise StoreUnavailableError(f"disk KV store {self.path} failed: {e}{note}") from e

    def _full_note(self) -> str:
        """LMDB reports a write cut short by a full filesystem as EIO; say when that is what happened."""
        try:
            st = os.statvfs(self.path)
        except OSError:
            return ""
        free = st.f_bavail * st.f_frsize
        return f" (its filesystem is full: {free} bytes free)" if free < self._slack else ""


def _read_lru(txn: lmdb.Transaction, order_db: lmdb._Database) -> OrderedDict[bytes, _Entry]:
    entries = [(key, _order_entry(raw)) for key, raw in txn.cursor(db=order_db)]
    entries.sort(key=lambda item: item[1].seq)
    return OrderedDict(entries)



def _order_entry(record: bytes) -> _Entry:
    """An `order` record; one written before owners were kept ends after the numbers (then the owner is b"").
    A record shorter than the numbers raises struct.error (a damaged page)."""
    seq, charge = _ORDER.unpack_from(record)
    return _Entry(seq, charge, bytes(record[_ORDER.size:]))


def _drop_oldest_quarantined(txn: lmdb.Transaction, quarantine_db: lmdb._Database) -> None:
    while txn.stat(quarantine_db)["entries"] > MAX_QUARANTINED:
        oldest, _ = min(txn.cursor(db=quarantine_db), key=lambda item: _QUARANTINE_HEADER.unpack_from(item[1])[0])
        txn.delete(bytes(oldest), db=quarantine_db)
