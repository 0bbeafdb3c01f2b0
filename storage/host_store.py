"""The host tier: chunk values in one preallocated slab of fixed-size slots.

    slab  uint8 [num_slots, slot_bytes]   one chunk per slot, values stored raw (no codec)

The slab is allocated once, so the tier never fragments and never allocates on
the copy path. With CUDA it is pinned (page-locked): device<->host copies then
run as DMA, and the budget is RAM the kernel can never swap out. Without CUDA it
is ordinary pageable memory (`pinned` is False in the stats).

When every slot is taken, a put reuses the least recently used slot. Copies run
under the store's lock, so a slot is never rewritten while another thread reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtierd.storage.chunk_store import StoreStats
from kvtierd.storage.store_errors import StoreUnavailableError


@dataclass(slots=True)
class _Slot:
    index: int  # row of the slab
    nbytes: int  # bytes of the value in it (a value may be shorter than the slot)


class HostStore:
    """A ChunkStore in host memory, plus tensor copies in and out of slots for the tier manager."""

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.num_slots = capacity_bytes // slot_bytes
        if self.num_slots == 0:
            raise ValueError(f"a host budget of {capacity_bytes} bytes holds no slot of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self.pinned = torch.cuda.is_available()
        self._slab = torch.empty((self.num_slots, slot_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self._rows = self._slab.numpy()  # the same memory, for copies from and to bytes
        self._index: OrderedDict[bytes, _Slot] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots))
        self._lock = threading.Lock()
        self._closed = False
        self._used = 0
        self._num_puts = self._num_gets = self._num_hits = 0
        self._num_evictions = self._num_rejected = 0

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            self._check_open()
            slots = [self._use(key) for key in keys]
            return [None if s is None else self._rows[s.index, : s.nbytes].tobytes() for s in slots]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> bool:
        batch = dict(items)  # a key given twice keeps its last value
        for value in batch.values():
            self._check_size(len(value))
        with self._lock:
            self._check_open()
            if len(batch) > self.num_slots:
                self._num_rejected += 1
                return False
            # Keys being rewritten keep their slots, and are out of the LRU while the others take theirs.
            reused = {key: self._index.pop(key) for key in batch if key in self._index}
            for key, value in batch.items():
                slot = reused.get(key) or self._take_slot()
                self._used += len(value) - slot.nbytes
                slot.nbytes = len(value)
                self._rows[slot.index, : slot.nbytes] = np.frombuffer(value, dtype=np.uint8)
                self._index[key] = slot
            self._num_puts += len(batch)
            return True

    def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            self._check_open()
            deleted = 0
            for key in keys:
                slot = self._index.pop(key, None)
                if slot is not None:
                    self._release(slot)
                    deleted += 1
            return deleted

    def get_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Copies the value into `out` (contiguous, any dtype or device, exactly the value's size). False on a miss."""
        with self._lock:
            self._check_open()
            slot = self._use(key)
            if slot is None:
                return False
            dst = _as_bytes(out)
            if dst.numel() != slot.nbytes:
                raise ValueError(f"out has {dst.numel()} bytes, the value has {slot.nbytes}")
            dst.copy_(self._slab[slot.index, : slot.nbytes])
            return True

    def put_from(self, key: bytes, tensor: torch.Tensor) -> bool:
        """Stores a contiguous tensor's bytes under `key` (a device tensor is copied to host), as put_many does."""
        src = _as_bytes(tensor)
        self._check_size(src.numel())
        with self._lock:
            self._check_open()
            slot = self._index.pop(key, None) or self._take_slot()
            self._used += src.numel() - slot.nbytes
            slot.nbytes = src.numel()
            self._slab[slot.index, : slot.nbytes].copy_(src)
            self._index[key] = slot
            self._num_puts += 1
            return True

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                num_entries=len(self._index),
                bytes_used=self._used,
                capacity_bytes=self.num_slots * self.slot_bytes,
                num_puts=self._num_puts,
                num_gets=self._num_gets,
                num_hits=self._num_hits,
                num_evictions=self._num_evictions,
                num_rejected=self._num_rejected,
                num_corrupt=0,  # raw values carry no checksum; the tier manager's token check guards hits
                num_quarantined=0,
                healthy=not self._closed,
                reason="closed" if self._closed else None,
                pinned=self.pinned,
            )

    def close(self) -> None:
        """Frees the slab; the store is unusable afterwards."""
        with self._lock:
            self._closed = True
            self._index.clear()
            self._slab = self._rows = None  # type: ignore[assignment]

    def _use(self, key: bytes) -> _Slot | None:
        """Looks a key up and counts it: a hit becomes the most recently used."""
        self._num_gets += 1
        slot = self._index.get(key)
        if slot is not None:
            self._num_hits += 1
            self._index.move_to_end(key)
        return slot

    def _take_slot(self) -> _Slot:
        """A free slot, or the least recently used one (its value is evicted). Caller holds the lock."""
        if self._free:
            return _Slot(self._free.pop(), 0)
        _, slot = self._index.popitem(last=False)
        self._num_evictions += 1
        return slot

    def _release(self, slot: _Slot) -> None:
        self._used -= slot.nbytes
        self._free.append(slot.index)

    def _check_size(self, nbytes: int) -> None:
        # A chunk never outgrows its slot; a bigger value is the caller's bug.
        if nbytes > self.slot_bytes:
            raise ValueError(f"a value of {nbytes} bytes does not fit a slot of {self.slot_bytes}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError("the host KV store is closed")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: no copy, so a copy into it lands in the tensor."""
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)
