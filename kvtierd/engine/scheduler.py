"""Builds each engine step under a token budget (continuous batching).

Running requests are served first, highest class first and in admission
order inside a class: a decode takes one token of the budget, an unfinished
prefill takes as many as remain (chunked prefill). Waiting requests are
admitted with what is left, in the order the QoS queue gives
(`engine/qos_queue.py`: class, then weighted fair queuing between tenants,
with aging); on admission a request adopts the longest cached prefix of its
tokens (its session's context pool, its tenant's prefix index or the public
one) and computes only the rest. A lower-class request cannot take the
reserved region's pages; when it finds no room, its class waits this step and
the others may still go.

Preemption: when pages run out for a running request, the lowest-class, most
recently admitted one goes (the end of `running`). Before that, a waiting
request that outranks running ones and would not fit takes their room: the
lower-class running requests are preempted, lowest first, until it fits. A
preempted request's pages are freed and it goes back to the head of its queue
to be recomputed, which reproduces the same tokens. A request that waits past
its class's `max_queue_s` without being admitted is refused (`plan.rejected`);
while a high request has waited `shed_low_after_s`, queued low requests are
refused too (`plan.shed`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtierd.cache.block_hash import BlockHash, hash_full_blocks
from kvtierd.cache.kv_cache_manager import NO_HIT, Allocation, KVCacheManager
from kvtierd.engine.config import QOS_CLASSES, QosConfig
from kvtierd.engine.qos_queue import QosQueue, TenantKey
from kvtierd.engine.request import Request

RANK = {c: i for i, c in enumerate(QOS_CLASSES)}  # 0: high


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    allocation: Allocation


@dataclass(slots=True)
class StepPlan:
    """Single-token entries (decodes) first, then prefill chunks, as `PagedBatch` wants."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # waited past their class's max_queue_s
    shed: list[Request] = field(default_factory=list)  # low, refused while a high request waits (shed_low_after_s)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_prefix_caching: bool = True, qos: QosConfig | None = None) -> None:
        qos = qos or QosConfig()
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_queue_s: Mapping[str, float] = qos.max_queue_s
        self.shed_low_after_s = qos.shed_low_after_s
        self.waiting = QosQueue(qos.weights, qos.aging_s, time.monotonic)
        self.running: list[Request] = []  # highest class first, then in admission order

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request and frees its pages at once."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def schedule(self) -> StepPlan:
        plan = StepPlan(rejected=self.waiting.timed_out(self.max_queue_s),
                        shed=self.waiting.shed_low(self.shed_low_after_s))
        budget = self.max_num_batched_tokens
        fresh: set[str] = set()  # admitted this step, already in the plan
        first = self._make_room_for_waiting(plan, budget)
        # Admitted before the running ones are served, or they would take the room just made.
        if first is not None and (n := self._admit(first, plan, budget)) is not None:
            budget -= n
            fresh.add(first.request_id)
        short = False  # a running request had to preempt: memory is short, admit nobody

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in fresh:
                i += 1
                continue
            n = min(req.num_pending_tokens, budget)
            alloc = self.kv.allocate_slots(req.request_id, n)
            while alloc is None:
                short = True
                victim = self._pop_victim(fresh)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
                alloc = self.kv.allocate_slots(req.request_id, n)
            if alloc is None:
                break
            self._add_to_plan(plan, ScheduledRequest(req, n, alloc))
            budget -= n
            i += 1

        inflight = self._inflight_hashes() if self.enable_prefix_caching and self.waiting else set()
        no_room: set[str] = set()  # classes that found no pages this step
        deferred: set[TenantKey] = set()  # tenants whose next request waits for a prefix being computed
        while budget > 0 and len(self.running) < self.max_num_seqs and not short:
            req = self.waiting.peek(no_room, deferred)
            if req is None:
                break
            if inflight and not inflight.isdisjoint(self._prompt_hashes(req)):
                deferred.add((req.qos_class, req.cache_root))  # its prefix is being computed: wait and reuse it
                continue
            n = self._admit(req, plan, budget)
            if n is None:
                if req.high:
                    break  # the reserve is open to high: nobody else would fit either
                no_room.add(req.qos_class)
                continue
            budget -= n
            if self.enable_prefix_caching:
                inflight.update(self._pending_prompt_hashes(req))
        return plan

    def _admit(self, req: Request, plan: StepPlan, budget: int) -> int | None:
        """Starts a waiting request with its cached prefix and first chunk; the tokens it took, or None
        (nothing changes) when its class finds no room."""
        self._adopt_cached_prefix(req)
        n = min(req.num_pending_tokens, budget)
        alloc = self.kv.allocate_slots(req.request_id, n, req.high)
        if alloc is None:
            self.kv.free(req.request_id)  # the adopted pages go back to the cache
            req.num_computed_tokens = 0
            return None
        self.waiting.admitted(req, req.num_pending_tokens)
        self._start_running(req)
        self._add_to_plan(plan, ScheduledRequest(req, n, alloc))
        return n

    def _pop_victim(self, fresh: set[str]) -> Request:
        """The last running request not admitted this step (those are in the plan already)."""
        j = max(j for j, r in enumerate(self.running) if r.request_id not in fresh)
        return self.running.pop(j)

    def _make_room_for_waiting(self, plan: StepPlan, budget: int) -> Request | None:
        """Preempts lower-class running requests, lowest first, until the request next in line fits
        (its first chunk's pages, counted without cache hits; a seat if max_num_seqs are running).
        Returns it when it preempted for it: it is admitted first."""
        req = self.waiting.peek()
        if req is None or not self.running or RANK[self.running[-1].qos_class] <= RANK[req.qos_class]:
            return None
        need = -(-min(req.num_pending_tokens, budget) // self.kv.block_size) + 1

        def short() -> bool:
            return self.kv.pool.num_free_blocks_for(req.high) < need or len(self.running) >= self.max_num_seqs

        preempted = False
        while short() and self.running and RANK[self.running[-1].qos_class] > RANK[req.qos_class]:
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            preempted = True
        return req if preempted else None

    def _start_running(self, req: Request) -> None:
        """Inserts `req` after the running requests of its class or higher: the end of the list goes first."""
        i = len(self.running)
        while i > 0 and RANK[self.running[i - 1].qos_class] > RANK[req.qos_class]:
            i -= 1
        self.running.insert(i, req)

    def _prompt_hashes(self, req: Request) -> list[BlockHash]:
        if req.prompt_block_hashes is None:
            req.prompt_block_hashes = hash_full_blocks(req.cache_root, req.prompt_token_ids, self.kv.block_size,
                                                       algorithm=self.kv.hash_algorithm)
        return req.prompt_block_hashes

    def _pending_prompt_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the prompt pages `req` has yet to compute (and index)."""
        return self._prompt_hashes(req)[len(self.kv.table(req.request_id).block_hashes) :]

    def _inflight_hashes(self) -> set[BlockHash]:
        """Prompt pages running requests are computing now. A waiting request that
        shares one waits for it instead of computing the same pages privately."""
        return {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
                for h in self._pending_prompt_hashes(r)}

    def _adopt_cached_prefix(self, req: Request) -> None:
        hit = self.kv.find_prefix(req.cache_root, req.token_ids, req.session_id) if self.enable_prefix_caching \
            else NO_HIT
        hit = self.kv.adopt_prefix(req.request_id, hit, req.tag, req.high)  # loads what the lower tiers hold
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:  # what the client is told: the first admission's hit
            req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens)
            req.cache_source = hit.source
            req.tokens_from_below = hit.tokens_by_tier
            req.restore = hit.restore
            req.first_scheduled_time = time.monotonic()

    def _add_to_plan(self, plan: StepPlan, s: ScheduledRequest) -> None:
        # Any single new token attends like a decode, whatever its phase.
        (plan.decodes if s.num_new_tokens == 1 else plan.prefills).append(s)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.add(req, front=True)
