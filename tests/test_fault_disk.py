"""The disk tier damaged under the daemon: a filesystem that fills up mid-run, flipped bytes in stored
values, a truncated data.mdb. Requests are served all along, their replies equal a cold computation
(damaged KV is never served), and the tier says what happened in /admin/tiers and /metrics.

The store-level tests come first (fast, no model): they pin down the faults LMDB itself handles badly or
vaguely: a data.mdb cut short (LMDB would kill the process with SIGBUS), bytes flipped at random in the
file, one full of garbage, and a full filesystem (LMDB reports the short write as EIO).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from daemon_fixtures import Daemon, start_daemon
from daemon_fixtures import wait_idle
from waiting import wait_until
from fault_fixtures import (OFFLOAD_ENV, checked_session_turns, disk_metric, errors_5xx, in_parallel, kill9, new_session, open_kv, question, remove_root, report, session_turn, short_root, small_filesystem, stop_cleanly, stored_keys, system_prompt, tiers, wait_disk_settled)
from kvtierd.storage.disk_store import DiskStore
from kvtierd.storage.store_errors import StoreUnavailableError
from kvtierd.storage.value_places import PAGE_HEADER, ValuePlace

SEED = 3
SESSIONS = 3
VALUE_BYTES = 300_000


# --- the store alone ---------------------------------------------------------------------------------

def fill_a_store(path: Path, n: int = 8) -> None:
    store = DiskStore(path, map_size=64 << 20)
    for i in range(n):
        assert store.put_many([(b"k%02d" % i, os.urandom(VALUE_BYTES))])
    store.close()


OPEN_AND_READ = textwrap.dedent("""
    import sys
    from kvtierd.storage.disk_store import DiskStore
    from kvtierd.storage.store_errors import StoreUnavailableError
    try:
        store = DiskStore(sys.argv[1], map_size=64 << 20)
    except StoreUnavailableError as e:
        print("unavailable:", e)
    else:
        print("opened:", sum(v is not None for v in store.get_many([b"k%02d" % i for i in range(8)])))
""")


@pytest.mark.parametrize("keep", [lambda size: size // 2 // 4096 * 4096, lambda size: size - 4096, lambda size: 8192],
                         ids=["half", "all-but-a-page", "meta-pages-only"])
def test_a_truncated_data_file_is_refused_at_open_not_a_crash(tmp_path, keep):
    fill_a_store(tmp_path)
    data = tmp_path / "data.mdb"
    os.truncate(data, keep(data.stat().st_size))
    # In a child: before the fix, LMDB's first read past the end killed the process with SIGBUS.
    done = subprocess.run([sys.executable, "-c", OPEN_AND_READ, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("unavailable:") and "is truncated" in done.stdout, done.stdout


USE_A_DAMAGED_STORE = textwrap.dedent("""
    import sys
    from kvtierd.storage.disk_store import DiskStore
    from kvtierd.storage.store_errors import StoreUnavailableError
    try:
        store = DiskStore(sys.argv[1], map_size=64 << 20)
    except StoreUnavailableError:
        sys.exit(print("refused at open"))
    keys = [b"k%03d" % i for i in range(120)]
    try:
        store.get_many(keys)
        store.put_many([(b"new%02d" % i, b"x" * 5000) for i in range(10)])
        store.delete_many(keys[::3])
    except StoreUnavailableError:
        sys.exit(print("failed in use"))
    print("worked")
""")


def test_bytes_flipped_at_random_in_the_file_are_survived(tmp_path, capsys):
    """LMDB has no page checksums: a flipped byte in its trees is caught (MDB_CORRUPTED, a page number out
    of range, an LRU record of the wrong size) or not at all. The process lives on, and the store is
    refused, fails closed, or works (a value read wrong still fails its frame's checks in the tier manager).

    Not every damage is survived: a flipped node size or page number can send LMDB's read past the file's
    end, which is SIGBUS (2 files in 1,000 so damaged; none of these 30 seeded ones). Extending data.mdb
    sparsely to the map size does not help: the same reads then run past the map, SIGSEGV."""
    rng = random.Random(SEED)
    base = tmp_path / "base"
    base.mkdir()
    store = DiskStore(base, map_size=64 << 20)
    for i in range(120):  # values of one page, several pages, and a few in a leaf: every kind of page
        assert store.put_many([(b"k%03d" % i, rng.randbytes(rng.choice([100, 2000, 30000])))])
    store.close()
    pristine = (base / "data.mdb").read_bytes()
    outcomes: Counter[str] = Counter()
    for trial in range(30):
        damaged = tmp_path / f"t{trial}"
        damaged.mkdir()
        data = bytearray(pristine)
        for _ in range(64):
            data[rng.randrange(2 * 4096, len(data))] ^= 1 << rng.randrange(8)  # past the two meta pages
        (damaged / "data.mdb").write_bytes(data)
        done = subprocess.run([sys.executable, "-c", USE_A_DAMAGED_STORE, str(damaged)], capture_output=True,
                              text=True)
        assert done.returncode == 0, (trial, done.returncode, done.stderr[-2000:])
        outcomes[done.stdout.strip()] += 1
    report(capsys, "random byte flips in data.mdb", files=30, flips_each=64, **dict(outcomes), crashes=0)


def test_a_garbage_data_file_is_refused_at_open(tmp_path):
    (tmp_path / "data.mdb").write_bytes(random.Random(SEED).randbytes(1 << 20))
    with pytest.raises(StoreUnavailableError, match="not an LMDB file"):
        DiskStore(tmp_path, map_size=64 << 20)


def test_a_full_filesystem_makes_the_store_unhealthy_saying_so(tmp_path):
    kv = tmp_path / "kv"
    with small_filesystem(kv, 4):
        store = DiskStore(kv, map_size=256 << 20)  # a map larger than the filesystem: it fills first
        stored = 0
        with pytest.raises(StoreUnavailableError, match="filesystem is full"):
            for i in range(20):
                assert store.put_many([(b"k%02d" % i, os.urandom(VALUE_BYTES))])
                stored += 1
        stats = store.stats()
        assert not stats.healthy and "filesystem is full" in stats.reason, stats
        assert stored > 0 and stats.num_entries == stored
        store.close()
        again = DiskStore(kv, map_size=256 << 20)  # every committed batch is still there, whole
        assert again.stats().healthy and sum(v is not None for v in again.get_many(
            [b"k%02d" % i for i in range(stored)])) == stored
        again.close()


# --- the daemon ---------------------------------------------------------------------------------------------

DISK_FS_MIB = 4  # a few chunks: a chunk of 2 float32 pages is about 1.2 MiB on disk
FULL_ENV = {**OFFLOAD_ENV, "KVTIERD_KV_CACHE_BYTES": "12MiB"}  # 17 pages: each chat below evicts the one before


@dataclass
class Daemons:
    full: Daemon  # its disk tier on a 4 MiB filesystem, with a 256 MiB map: it fills up mid-run
    filesystem: str
    truncated: Daemon  # data.mdb cut to half its size before the start
    flipped: Daemon  # restarted on a clean stop's state with a byte flipped in every stored value
    sessions: list[str]  # the flipped daemon's sessions, whose pages are all on disk
    values_flipped: int


def flip_a_byte_in_every_value(kv_dir: Path, rng: random.Random) -> int:
    """Where each value's bytes lie, so the file stays a valid LMDB file and only the values are wrong: a large
    value's in its overflow pages, at the place the disk tier reads it from (bit rot does not move bytes); one
    inside a leaf page through LMDB itself. Every other value is hit in its first 64 bytes (the header: magic,
    geometry, lengths, checksum), the others anywhere (mostly the payload)."""
    in_file: list[int] = []  # offsets in data.mdb
    with open_kv(kv_dir, write=True) as (env, dbs), env.begin(write=True) as txn:
        page_size = env.stat()["psize"]
        items = [(bytes(k), bytearray(v)) for k, v in txn.cursor(db=dbs["values"])]
        for i, (key, value) in enumerate(items):
            offset = rng.randrange(min(64, len(value)) if i % 2 == 0 else len(value))
            record = txn.get(key, db=dbs["places"])
            if record is not None:
                in_file.append(ValuePlace.unpack(record).page * page_size + PAGE_HEADER.size + offset)
            else:
                value[offset] ^= 1 << rng.randrange(8)
                txn.put(key, bytes(value), db=dbs["values"])
    with open(kv_dir / "data.mdb", "r+b") as f:
        for at in in_file:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 1 << rng.randrange(8)]))
    return len(items)


@pytest.fixture(scope="module")
def daemons() -> Iterator[Daemons]:
    """The disk-full daemon; one that runs three sessions and stops cleanly (its drain flushes every
    session's pages to disk), then restarts on that state after a byte was flipped in every value; and one
    on a data.mdb (of random values) cut to half its size. (One after another: on two cores, starts side
    by side take longer than in a row.)"""
    rng = random.Random(SEED)
    roots = {name: short_root() for name in ("full", "flipped", "truncated")}
    started: list[Daemon] = []
    try:
        with contextlib.ExitStack() as mounts:
            filesystem = mounts.enter_context(small_filesystem(roots["full"] / "state" / "kv", DISK_FS_MIB))
            started += [start_daemon(roots["full"], env=FULL_ENV), start_daemon(roots["flipped"], env=OFFLOAD_ENV)]
            full, first = started
            with first.client() as c:
                sessions = [new_session(c, system_prompt(20 + i)) for i in range(SESSIONS)]
            in_parallel(first, [partial(session_turn, sid=sid, content=question(0)) for sid in sessions])
            stop_cleanly(first)
            values_flipped = flip_a_byte_in_every_value(roots["flipped"] / "state" / "kv", rng)
            kv = roots["truncated"] / "state" / "kv"
            kv.mkdir(parents=True)
            fill_a_store(kv, 16)
            os.truncate(kv / "data.mdb", (kv / "data.mdb").stat().st_size // 2 // 4096 * 4096)
            started += [start_daemon(roots[name], env=OFFLOAD_ENV) for name in ("flipped", "truncated")]
            flipped, truncated = started[2:]
            yield Daemons(full, filesystem, truncated, flipped, sessions, values_flipped)
            for d in started:
                stop_cleanly(d)
    finally:
        for d in started:
            kill9(d)
        for root in roots.values():
            remove_root(root)


def chat_body(n: int) -> dict:
    """A stateless chat of about 200 tokens of its own: 13 pages that push others out of the device."""
    return {"messages": [{"role": "system", "content": system_prompt(n) * 3},
                         {"role": "user", "content": question(n)}], "temperature": 0, "max_tokens": 4}


def test_a_disk_that_fills_up_mid_run(daemons, capsys):
    d = daemons.full
    with d.client() as c:
        assert tiers(c)["disk"]["healthy"]
        sid = new_session(c, system_prompt(40))
        statuses: Counter[int] = Counter()
        writes_before = 0
        for n in range(20):
            statuses[c.post("/v1/chat/completions", json=chat_body(n)).status_code] += 1
            disk = wait_disk_settled(c)
            if not disk["healthy"]:
                writes_before = disk["writes"]
                break
        assert writes_before > 0, f"the disk tier never filled up, or never wrote before: {disk}"
        # It keeps serving: another stateless chat, and a session's turns (written through to a dead disk).
        statuses[c.post("/v1/chat/completions", json=chat_body(20)).status_code] += 1
        session_turn(c, sid, question(0))
        statuses[200] += 1
        checked_session_turns(d, [(sid, question(1))])  # equal to a cold run
        statuses[200] += 2
        wait_idle(c)
        disk = tiers(c)["disk"]
        assert disk["enabled"] and not disk["healthy"] and "filesystem is full" in disk["reason"], disk
        assert disk["dropped_writes"] > 0, disk
        assert disk_metric(c, "kvtierd_tier_healthy") == 0
        assert disk_metric(c, "kvtierd_tier_dropped_writes_total") == disk["dropped_writes"]
        assert set(statuses) == {200} and errors_5xx(c) == 0, statuses
    assert "disk KV tier failed, continuing without it" in d.log_text()
    report(capsys, "disk full", filesystem=f"{daemons.filesystem} of {DISK_FS_MIB} MiB",
           disk_writes_before_full=writes_before, dropped_writes=disk["dropped_writes"],
           requests_served=sum(statuses.values()), **{"5xx seen": 0}, reason=repr(disk["reason"]))


def test_flipped_bytes_in_stored_values_are_caught_and_never_served(daemons, capsys):
    d = daemons.flipped
    assert daemons.values_flipped >= 2 * SESSIONS  # a few chunks per session
    with d.client() as c:
        disk = tiers(c)["disk"]
        # Every damaged value is still there, or already caught (the startup warm-up reads the recent
        # sessions' chunks), or was an earlier turn's partial chunk, which the reconciliation removed.
        caught = disk["entries"] + disk["corrupt"] + disk["reconciled"]["orphan_values"]
        assert disk["enabled"] and disk["healthy"] and caught == daemons.values_flipped, disk
    # Each session's next turn finds its chunks on disk, every one damaged: a miss, recomputed.
    turns = checked_session_turns(d, [(sid, question(2)) for sid in daemons.sessions])
    assert all(t.cached_by_tier["disk"] == 0 for t in turns), [t.cached_by_tier for t in turns]
    with d.client() as c:
        # Quarantining runs on the disk writer's thread.
        wait_until(lambda: tiers(c)["disk"]["corrupt"] >= SESSIONS, "every damaged session's value quarantined")
        disk = tiers(c)["disk"]
        assert disk["corrupt"] >= SESSIONS and disk["healthy"], disk
        assert disk_metric(c, "kvtierd_tier_corrupt_values_total") == disk["corrupt"]
        assert errors_5xx(c) == 0
    assert "failed its" in d.log_text()
    stop_cleanly(d)
    # The bad values were moved aside, not deleted (the recomputed turns stored good ones under their keys): each
    # one caught by the count above, and any a reader still running then (a prefetch) caught before the stop.
    quarantined = stored_keys(d.state_dir / "kv", "quarantine")
    assert min(disk["corrupt"], 16) <= len(quarantined) <= min(daemons.values_flipped, 16)
    report(capsys, "flipped bytes", values_flipped=daemons.values_flipped, turns_checked_against_cold=len(turns),
           corrupt_values_caught=disk["corrupt"], quarantined=len(quarantined), **{"5xx seen": 0})


def test_a_truncated_data_file_leaves_the_daemon_serving_without_the_disk_tier(daemons, capsys):
    d = daemons.truncated
    with d.client() as c:
        disk = tiers(c)["disk"]
        assert not disk["enabled"] and not disk["healthy"] and "is truncated" in disk["reason"], disk
        assert disk_metric(c, "kvtierd_tier_healthy") == 0
        assert tiers(c)["host"]["healthy"]
        sid = new_session(c, system_prompt(30))
        session_turn(c, sid, question(0))
    checked_session_turns(d, [(sid, question(1))])  # equal to a cold run
    with d.client() as c:
        assert errors_5xx(c) == 0
    assert "serving without the disk KV tier" in d.log_text()
    report(capsys, "truncated data.mdb", disk_healthy=False, reason=repr(disk["reason"]),
           turns_checked_against_cold=1, **{"5xx seen": 0})
