"""The host tier: a slab of fixed-size slots, LRU when full, exact tensor copies in and out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtierd.storage.host_store import HostStore
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
    with pytest.raises(ValueError, match="does not fit a slot"):
        store.put_from(key(0), torch.zeros(SLOT + 1, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_put_from_and_get_into_copy_exactly(dtype: torch.dtype) -> None:
    store = HostStore(capacity_bytes=4 << 10, slot_bytes=1 << 10)
    kv = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # [layers*2, block, heads, dim]
    assert store.put_from(key(0), kv)
    out = torch.empty_like(kv)
    assert store.get_into(key(0), out)
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    # The same bytes through the bytes interface, both ways.
    assert store.get_many([key(0)]) == [kv.view(torch.uint8).numpy().tobytes()]
    store.put_many([(key(1), kv.view(torch.uint8).numpy().tobytes())])
    out.zero_()
    assert store.get_into(key(1), out) and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_get_into_on_a_miss_leaves_the_tensor_alone() -> None:
    store = make_store()
    out = torch.full((SLOT,), 7, dtype=torch.uint8)
    assert not store.get_into(key(0), out)
    assert torch.equal(out, torch.full((SLOT,), 7, dtype=torch.uint8))
    assert store.stats().num_gets == 1 and store.stats().num_hits == 0


def test_get_into_needs_a_contiguous_tensor_of_the_values_size() -> None:
    store = make_store()
    store.put_many([(key(0), value(0))])
    with pytest.raises(ValueError, match="out has 32 bytes"):
        store.get_into(key(0), torch.empty(32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        store.get_into(key(0), torch.empty(8, 16, dtype=torch.uint8).t())


def test_threads_never_read_a_slot_mid_rewrite() -> None:
    store = make_store(8)

    def work(t: int) -> None:
        for n in range(200):
            i = t * 1000 + n
            src = torch.full((SLOT,), i % 251, dtype=torch.uint8)
            store.put_from(key(i), src)
            out = torch.empty(SLOT, dtype=torch.uint8)
            if store.get_into(key(i), out):
                assert torch.equal(out, src)

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
    assert store.put_from(key(0), kv)
    out = torch.empty_like(kv)
    assert store.get_into(key(0), out)
    assert torch.equal(out, kv)
