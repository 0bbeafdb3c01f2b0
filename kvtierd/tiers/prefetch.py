"""Copies up to the host tier, on a thread of their own (disk reads and Redis round trips never wait in the
engine's step):

    disk / remote --prefetch--> host slab   as soon as a request arrives, the chunks of its chain only they hold
    disk --warm--> host slab                at startup, the chunks of recently active sessions

A chunk prefetched for a request still counts for the tier that had it when that request loads it
(`origin`), and a load of a chunk whose prefetch is under way waits for it (`wait_for`) rather than
reading it a second time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtierd.tiers.background_work import BACKGROUND_WORK, init_worker_thread
from kvtierd.tiers.chunk import FoundChunk
from kvtierd.tiers.disk_backend import DiskBackend
from kvtierd.tiers.host_backend import HostBackend
from kvtierd.tiers.tier import Tier
from kvtierd.tiers.tier_stats import TierCounts
from kvtierd.tiers.writer_backend import WriterBackend

log = logging.getLogger(__name__)

MAX_PREFETCHED_ORIGINS = 4096  # host keys whose origin tier is remembered until a load uses them

Lookup = Callable[[bytes, Sequence[bytes], Sequence[int], int], list[FoundChunk]]


class Prefetcher:
    def __init__(self, host: HostBackend, below: dict[Tier, WriterBackend], counts: dict[Tier, TierCounts],
                 lookup: Lookup) -> None:
        self._host = host
        self._below = below  # the tiers it copies from
        self._counts = counts
        self._lookup = lookup
        # Not a counted pool: most prefetches look a new prompt up, find nothing and end. Had they counted, a
        # step starting meanwhile (the prompt's own first) would leave them a core for its whole length.
        self._pool = ThreadPoolExecutor(1, "kvtierd-prefetch", initializer=init_worker_thread)
        self._lock = threading.Lock()
        self._prefetching: dict[bytes, Future] = {}  # host key -> its copy up, until done
        # host key -> the tier a prefetch copied it from, until a load uses it: that load counts for that tier
        self._origins: OrderedDict[bytes, Tier] = OrderedDict()

    def prefetch(self, namespace: bytes, block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int) -> None:
        """Starts copying up the chunks of a chain (from page `start`) that only the tiers below hold, so its
        request finds them in memory when it is scheduled. Returns at once."""
        self._pool.submit(self._prefetch, namespace, list(block_hashes), list(token_ids), start)

    def _prefetch(self, namespace: bytes, block_hashes: list[bytes], token_ids: list[int], start: int) -> None:
        try:
            for found in self._lookup(namespace, block_hashes, token_ids, start):
                source = self._below.get(found.tier)
                host_key = self._host.key(found.span.last_hash)
                if source is None or self._host.has(host_key):
                    continue  # in memory already (found below only because an earlier chunk of the run is not)
                done: Future = Future()
                with self._lock:
                    if host_key in self._prefetching:
                        continue
                    self._prefetching[host_key] = done
                try:
                    with BACKGROUND_WORK.counted():
                        payload = source.fetch(found.span)
                        if payload is None:
                            break  # the chain stops here: what follows is unreachable anyway
                        self._host.put(host_key, found.span.identity(self._host.geometry),
                                       lambda out, payload=payload: _copy_bytes(out, payload))
                    self._note(host_key, found.tier)
                finally:
                    with self._lock:
                        del self._prefetching[host_key]
                    done.set_result(None)
        except Exception:  # the executor would swallow it; a failed prefetch only costs a slower load
            log.exception("prefetching KV chunks to the host tier failed")

    def warm(self, disk: DiskBackend, keys: Sequence[bytes]) -> Future:
        """Copies these disk chunks up, in order, at most as many as the host tier has slots for (the last ones
        given are the most recent in its LRU). One chunk at a time, so a request's prefetch never waits behind
        the whole list. The future is done, with how many were copied, when the last one is."""
        done: Future = Future()
        todo = list(keys)[-self._host.storage.num_slots :]

        def step(i: int, warmed: int) -> None:
            try:
                while i < len(todo) and self._host.has(todo[i]):
                    i += 1
                if i == len(todo):
                    done.set_result(warmed)
                    return
                with BACKGROUND_WORK.counted():
                    claimed = disk.read_claimed(todo[i])
                    if claimed is not None:
                        identity, payload = claimed
                        self._host.put(todo[i], identity, lambda out: _copy_bytes(out, payload))
                if claimed is not None:
                    self._note(todo[i], Tier.DISK)
                    warmed += 1
                self._pool.submit(step, i + 1, warmed)
            except Exception as e:  # the executor would swallow it; a failed warm-up only costs slower loads
                log.exception("warming the host tier from disk failed")
                done.set_exception(e)

        self._pool.submit(step, 0, 0)
        return done

    def wait_for(self, block_hash: bytes) -> None:
        """Waits for a prefetch of this chunk that is under way: its copy is nearly done, a second read is not."""
        with self._lock:
            pending = self._prefetching.get(self._host.key(block_hash))
        if pending is not None:
            pending.result()

    def origin(self, block_hash: bytes, default: Tier) -> Tier:
        """The tier a load of this chunk counts for (once: the origin is forgotten)."""
        with self._lock:
            return self._origins.pop(self._host.key(block_hash), default)

    def wait(self) -> None:
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _note(self, host_key: bytes, tier: Tier) -> None:
        self._counts[tier].prefetched += 1
        with self._lock:
            self._origins[host_key] = tier
            while len(self._origins) > MAX_PREFETCHED_ORIGINS:  # prefetched for requests
                self._origins.popitem(last=False)  # that never loaded them


def _copy_bytes(out: torch.Tensor, payload: memoryview) -> None:
    out.view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
