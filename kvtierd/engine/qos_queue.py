"""Waiting requests, by QoS class and, inside a class, by tenant (weighted fair queuing).

Which request is admitted next:

- inside a class, the tenant with the least service so far (tokens admitted,
  divided by its weight: tenants weigh the same today) goes first, its
  requests in arrival order. A tenant that starts waiting again resumes at
  the least service of those waiting, so time spent idle is not banked: one
  tenant's burst cannot starve the others, nor can a returning tenant starve
  the burst.
- between classes, the head of each class scores `weight + waited /
  aging_s` and the best score goes first. A fresh high request (weight 8)
  beats a fresh low one (weight 1), but a low request that has waited
  7 x aging_s more than the oldest waiting high one beats it. Aging is added,
  not multiplied by the weight: under a growing high backlog, whose head ages
  too, a product would let high outscore low forever; a sum lets low in once
  the highs that arrived before it (and up to 7 x aging_s after) are served.

A preempted request goes back to the head of its tenant's queue and keeps
its arrival time (it has aged already).

Load shedding (`shed_low`): while a high request has waited `after_s` without
being admitted, the low requests never admitted are refused at once. They
hold no pages, so shedding frees none; it answers their clients now (503 with
Retry-After) instead of at their own, longer, timeout, and keeps aging from
handing the next free pages to low while high waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping

from kvtierd.cache.block_hash import BlockHash
from kvtierd.engine.config import QOS_CLASSES
from kvtierd.engine.request import Request

TenantKey = tuple[str, BlockHash]  # (class, tenant namespace)


class QosQueue:
    def __init__(self, weights: Mapping[str, float], aging_s: float, clock: Callable[[], float]) -> None:
        self.weights = dict(weights)
        self.aging_s = aging_s
        self._clock = clock
        self._queues: dict[str, dict[BlockHash, deque[Request]]] = {c: {} for c in QOS_CLASSES}
        self._service: dict[TenantKey, float] = {}  # tokens admitted per tenant and class
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (r for tenants in self._queues.values() for q in tenants.values() for r in q)

    def __contains__(self, req: object) -> bool:
        return any(req is r for r in self)

    def add(self, req: Request, front: bool = False) -> None:
        tenants = self._queues[req.qos_class]
        q = tenants.get(req.cache_root)
        if q is None:
            # Resume at the least service of the tenants waiting now: idle time is not banked.
            waiting = [self._service.get((req.qos_class, t), 0.0) for t in tenants]
            key = (req.qos_class, req.cache_root)
            self._service[key] = max(self._service.get(key, 0.0), min(waiting, default=0.0))
            q = tenants[req.cache_root] = deque()
        q.appendleft(req) if front else q.append(req)
        self._len += 1

    def remove(self, req: Request) -> bool:
        tenants = self._queues[req.qos_class]
        q = tenants.get(req.cache_root)
        if q is None or req not in q:
            return False
        q.remove(req)
        if not q:
            del tenants[req.cache_root]
        self._len -= 1
        return True

    def peek(self, skip_classes: Collection[str] = (), skip_tenants: Collection[TenantKey] = ()) -> Request | None:
        """The request to admit next, leaving out the classes and tenants given."""
        now = self._clock()
        best, best_score = None, -1.0
        for cls in QOS_CLASSES:
            if cls in skip_classes:
                continue
            tenants = [t for t in self._queues[cls] if (cls, t) not in skip_tenants]
            if not tenants:
                continue
            tenant = min(tenants, key=lambda t: self._service.get((cls, t), 0.0))
            head = self._queues[cls][tenant][0]
            score = self.weights[cls] + (now - head.arrival_time) / self.aging_s
            if score > best_score:
                best, best_score = head, score
        return best

    def admitted(self, req: Request, num_tokens: int) -> None:
        """Takes `req` off the queue and charges its tenant for the tokens it was admitted with."""
        self.remove(req)
        key = (req.qos_class, req.cache_root)
        self._service[key] = self._service.get(key, 0.0) + max(1, num_tokens)

    def timed_out(self, max_queue_s: Mapping[str, float]) -> list[Request]:
        """Removes and returns the requests never admitted that waited past their class's limit."""
        now = self._clock()
        late = [r for r in self if r.first_scheduled_time is None and max_queue_s[r.qos_class]
                and now - r.arrival_time > max_queue_s[r.qos_class]]
        for r in late:
            self.remove(r)
        return late

    def shed_low(self, after_s: float) -> list[Request]:
        """While a high request has waited `after_s` unadmitted, removes and returns the low ones never admitted."""
        now = self._clock()
        high_waits = after_s and any(r.first_scheduled_time is None and now - r.arrival_time >= after_s
                                     for q in self._queues["high"].values() for r in q)
        if not high_waits:
            return []
        shed = [r for q in self._queues["low"].values() for r in q if r.first_scheduled_time is None]
        for r in shed:
            self.remove(r)
        return shed
