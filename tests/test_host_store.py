"""The host tier: a slab of fixed-size slots, LRU when full, exact tensor copies in and out."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtierd.storage.host_store import ALIGN, HostStore
from kvtierd.storage.store_errors import StoreUnavailableError

SLOT = 64


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value(i: int, nbytes: int = SLOT) -> bytes:
    return bytes((i + j) % 256 for j in range(nbytes))


def make_store(num_slots: int = 4) -> HostStore:
    return HostStore(capacity_bytes=num_slots * SLOT + SLOT - 1, slot_bytes=SLOT)


def test_slots_come_from_the_budget() -> None:
    store = make_store(4)
    assert store.num_slots == 4
    assert store.stats().capacity_bytes == 4 * SLOT
    with pytest.raises(ValueError, match="holds no slot"):
        HostStore(capacity_bytes=SLOT - 1, slot_bytes=SLOT)


def test_the_slab_is_pinned_exactly_when_cuda_is_there() -> None:
    assert make_store().stats().pinned is torch.cuda.is_available()


def test_put_get_contains_delete() -> None:
    store = make_store()
    assert store.put_many([(key(0), value(0)), (key(1), value(1, 10)), (key(2), b"")])
    assert store.get_many([key(0), key(1), key(2), key(3)]) == [value(0), value(1, 10), b"", None]
    assert store.contains_prefix([key(0), key(1), key(3), key(2)]) == 2
    assert store.contains_each([key(3), key(2), key(0)]) == [False, True, True]  # past a miss too
    assert store.delete_many([key(1), key(3)]) == 1
    stats = store.stats()
    assert (stats.num_entries, stats.bytes_used, stats.num_puts, stats.num_gets, stats.num_hits) == (2, SLOT, 3, 4, 3)
    assert stats.healthy and stats.num_evictions == 0


def test_a_full_slab_reuses_the_least_recently_used_slot() -> None:
    store = make_store(4)
    store.put_many([(key(i), value(i)) for i in range(4)])
    store.get_many([key(0)])  # order now 1, 2, 3, 0
    store.put_many([(key(4), value(4))])
    assert store.contains_prefix([key(1)]) == 0
    store.put_many([(key(5), value(5)), (key(6), value(6))])
    assert [store.contains_prefix([key(i)]) for i in range(7)] == [1, 0, 0, 0, 1, 1, 1]
    assert store.get_many([key(0), key(4)]) == [value(0), value(4)]
    assert store.stats().num_evictions == 3


def test_rewriting_a_key_keeps_its_slot() -> None:
    store = make_store(2)
    store.put_many([(key(0), value(0)), (key(1), value(1))])
    store.put_many([(key(0), value(9, 5))])
    assert store.get_many([key(0), key(1)]) == [value(9, 5), value(1)]
    assert store.stats().num_evictions == 0 and store.stats().bytes_used == SLOT + 5


def test_a_batch_larger_than_the_slab_is_refused_whole() -> None:
    store = make_store(2)
    store.put_many([(key(0), value(0))])
    assert not store.put_many([(key(i), value(i)) for i in range(1, 4)])
    assert store.get_many([key(0), key(1)]) == [value(0), None]
    assert store.stats().num_rejected == 1


def test_a_value_larger_than_a_slot_is_the_callers_bug() -> None:
    store = make_store()
    with pytest.raises(ValueError, match="does not fit a slot"):
        store.put_many([(key(0), bytes(SLOT + 1))])
    with pytest.raises(ValueError, match="does not fit a slot"):  # write needs room to align the value too
        store.write(key(0), SLOT - ALIGN + 2, lambda view: None)
    assert store.stats().num_entries == 0


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head", [0, 5, 63])
def test_write_aligns_the_payload_and_read_sees_the_same_bytes(dtype: torch.dtype, head: int) -> None:
    store = HostStore(capacity_bytes=4 << 10, slot_bytes=1 << 10)
    kv = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(head)).to(dtype)
    nbytes = head + kv.numel() * kv.element_size()

    def fill(view: torch.Tensor) -> None:
        view[:head] = 7
        view[head:].copy_(as_bytes(kv))

    for i in range(3):  # other slots, other offsets
        store.write(key(i), nbytes, fill, align_at=head)
        got = store.read(key(i), lambda view: (view.data_ptr() + head, view[head:].view(dtype).clone()))
        assert got is not None
        address, payload = got
        assert address % ALIGN == 0 and torch.equal(as_bytes(payload), as_bytes(kv))
        assert store.get_many([key(i)]) == [bytes([7] * head) + as_bytes(kv).numpy().tobytes()]
    assert store.stats().bytes_used == 3 * nbytes


def test_read_on_a_miss_calls_nothing() -> None:
    store = make_store()
    assert store.read(key(0), lambda view: pytest.fail("called on a miss")) is None
    assert store.stats().num_gets == 1 and store.stats().num_hits == 0


def test_a_failing_fill_leaves_the_key_absent_and_its_slot_free() -> None:
    store = HostStore(capacity_bytes=2 << 10, slot_bytes=1 << 10)
    store.put_many([(key(0), value(0))])

    def fail(view: torch.Tensor) -> None:
        raise RuntimeError("device gone")

    for k in (key(0), key(1)):  # a rewrite and a new key
        with pytest.raises(RuntimeError):
            store.write(k, 100, fail)
    assert store.contains_prefix([key(0)]) == 0 and store.contains_prefix([key(1)]) == 0
    stats = store.stats()
    assert stats.num_entries == 0 and stats.bytes_used == 0
    store.put_many([(key(2), value(2)), (key(3), value(3))])  # both slots are free again
    assert store.stats().num_evictions == 0


def test_threads_never_read_a_slot_mid_rewrite() -> None:
    store = HostStore(capacity_bytes=8 * 2 * SLOT, slot_bytes=2 * SLOT)

    def work(t: int) -> None:
        for n in range(200):
            i = t * 1000 + n
            src = torch.full((SLOT,), i % 251, dtype=torch.uint8)
            store.write(key(i), SLOT, lambda view: view.copy_(src))
            got = store.read(key(i), lambda view: view.clone())
            if got is not None:
                assert torch.equal(got, src)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    assert store.stats().num_entries == 8


def test_a_closed_store_is_unavailable() -> None:
    store = make_store()
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.get_many([key(0)])
    assert store.stats().healthy is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_tensors_copy_through_the_pinned_slab() -> None:
    store = HostStore(capacity_bytes=4 << 20, slot_bytes=1 << 20)
    assert store.stats().pinned
    kv = torch.randn(16, 16, 2, 64, device="cuda", dtype=torch.float16)
    store.write(key(0), kv.numel() * 2, lambda view: view.copy_(as_bytes(kv)))
    out = torch.empty_like(kv)
    store.read(key(0), lambda view: as_bytes(out).copy_(view))
    assert torch.equal(out, kv)


def test_pinned_values_are_passed_over_by_the_lru_until_unpinned_or_deleted() -> None:
    store = make_store(3)
    store.put_many([(key(i), value(i)) for i in range(3)])
    assert store.pin([key(0), key(1), key(9)]) == 2  # key 9 is not there
    store.put_many([(key(3), value(3))])  # evicts 2, the only unpinned one
    store.put_many([(key(4), value(4))])  # evicts 3
    assert [store.contains_prefix([key(i)]) for i in range(5)] == [1, 1, 0, 0, 1]
    assert not store.put_many([(key(5), value(5)), (key(6), value(6))])  # one slot is not pinned: refused whole
    store.unpin([key(0)])
    store.put_many([(key(5), value(5))])
    assert store.contains_prefix([key(0)]) == 0 and store.contains_prefix([key(1)]) == 1
    store.delete_many([key(1)])  # a delete ends the pin: the slot is free for anyone
    store.put_many([(key(6), value(6)), (key(7), value(7))])
    assert store.stats().num_entries == 3 and store.contains_prefix([key(1)]) == 0


def test_a_slab_of_pinned_values_refuses_a_write() -> None:
    store = make_store(2)
    store.put_many([(key(0), value(0)), (key(1), value(1))])
    store.pin([key(0), key(1)])
    with pytest.raises(StoreUnavailableError, match="pinned"):
        store.write(key(2), 1, lambda view: None)
    assert store.get_many([key(0), key(1)]) == [value(0), value(1)]


def test_a_slot_being_read_is_never_rewritten_and_is_freed_by_its_last_reader() -> None:
    store = make_store(2)
    store.put_many([(key(0), value(0)), (key(1), value(1))])
    reading, release = threading.Event(), threading.Event()

    def slow_copy(view: torch.Tensor) -> bytes:
        reading.set()
        release.wait()
        return view.numpy().tobytes()  # the bytes as they are now, after the writes below

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(store.read, key(0), slow_copy)
        reading.wait()
        other = store.read(key(1), lambda view: view.numpy().tobytes())  # not blocked by the held read
        store.put_many([(key(0), value(7))])  # its key rewritten: into another slot, key(1)'s (the LRU one)
        store.put_many([(key(2), value(2))])  # evicts key(0)'s new slot: the one being read is passed over
        release.set()
        assert held.result() == value(0) and other == value(1)
    assert store.get_many([key(0), key(1), key(2)]) == [None, None, value(2)]
    store.put_many([(key(3), value(3))])  # the read slot, freed by its reader: nothing evicted for it
    assert store.get_many([key(2), key(3)]) == [value(2), value(3)] and store.stats().num_entries == 2
