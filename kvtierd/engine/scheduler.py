"""Builds each engine step under a token budget (continuous batching).

Running requests are served first, in admission order: a decode takes one
token of the budget, an unfinished prefill takes as many as remain (chunked
prefill). Waiting requests are admitted FIFO with what is left; on admission a
request adopts the longest cached prefix of its tokens (its session's context
pool, its tenant's prefix index or the public one) and computes only the rest. When pages run
out for a running request, the most recently admitted one is preempted: its
pages are freed and it goes back to the head of the queue to be recomputed,
which reproduces the same tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvtierd.cache.block_hash import BlockHash, hash_full_blocks
from kvtierd.cache.kv_cache_manager import NO_HIT, Allocation, KVCacheManager
from kvtierd.engine.request import Request


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
                 enable_prefix_caching: bool = True) -> None:
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request and frees its pages at once."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_pending_tokens, budget)
            alloc = self.kv.allocate_slots(req.request_id, n)
            while alloc is None:
                victim = self.running.pop()
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

        # No admissions in a step that had to preempt: memory is short.
        inflight = self._inflight_hashes() if self.enable_prefix_caching and self.waiting else set()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            if inflight and not inflight.isdisjoint(self._prompt_hashes(req)):
                deferred.append(self.waiting.popleft())  # its prefix is being computed: wait and reuse it
                continue
            self._adopt_cached_prefix(req)
            n = min(req.num_pending_tokens, budget)
            alloc = self.kv.allocate_slots(req.request_id, n)
            if alloc is None:
                self.kv.free(req.request_id)  # the adopted pages go back to the cache
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            self._add_to_plan(plan, ScheduledRequest(req, n, alloc))
            budget -= n
            if self.enable_prefix_caching:
                inflight.update(self._pending_prompt_hashes(req))
        self.waiting.extendleft(reversed(deferred))
        return plan

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
        hit = self.kv.adopt_prefix(req.request_id, hit, req.tag)  # loads what the lower tiers hold
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:  # what the client is told: the first admission's hit
            req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens)
            req.cache_source = hit.source
            req.tokens_from_below = hit.tokens_by_tier
            req.first_scheduled_time = time.monotonic()

    def _add_to_plan(self, plan: StepPlan, s: ScheduledRequest) -> None:
        # Any single new token attends like a decode, whatever its phase.
        (plan.decodes if s.num_new_tokens == 1 else plan.prefills).append(s)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
