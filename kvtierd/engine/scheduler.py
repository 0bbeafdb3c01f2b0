"""Builds each engine step under a token budget (continuous batching).

Running requests are served first, highest class first and in admission
order inside a class: a decode takes one token of the budget, an unfinished
prefill takes as many as remain (chunked prefill). Waiting requests are
admitted with what is left, in the order the QoS queue gives
(`engine/qos_queue.py`: class, then weighted fair queuing between tenants,
with aging), except that the top class's (below) are admitted before the
lower classes' running requests are served; on admission a request adopts the longest cached prefix of its
tokens (its session's context pool, its tenant's prefix index or the public
one) and computes only the rest. A lower-class request cannot take the
reserved region's pages; when it finds no room, its class waits this step and
the others may still go.

Loading: a request whose prefix is found below the device (host, disk,
remote) leaves the queue while its chunks load on the transfer workers
(`cache/loading.py`); the steps go on with everyone else. Each step looks at
the loading requests first: one whose loads all arrived (or whose deadline,
the planner's recompute estimate, passed) goes back to the head of its
tenant's queue, holding no pages (the loaded ones are cached), and is admitted
with them as its cached prefix, recomputing what did not arrive (or was
evicted meanwhile). While others decode, the rest of its prompt (the new
message past a restored history) goes in pieces that keep their step within
RESTORED_STEP_SHARE over their decodes' cost, when RESTORED_MAX_PIECES of them suffice:
in one piece, each of its tokens attends over the whole loaded context, and
the streams' step ran 3-5x its time.

Split joins: a piece of one token is cut by layers instead. A cached prompt's
last token beside running decodes whose context would add JOIN_SPLIT_SHARE to
their step goes through the first half of the layers in one step and the rest
in the next (`_split_joins`; engine/model_runner.py runs the two parts), its
slot allocated once; preempted between them, it starts again.

Prefills beside decodes: running requests' decodes are planned before any
prefill chunk, and a chunk is sized beside them. A prompt (of their class or
a lower one) computes, while they decode, in chunks of at most
`prefill_chunk_beside_decodes` tokens (the daemon's default: 256), so the
streams' longest gap is one such chunk's step rather than a whole token
budget's; alone, a prompt takes the whole budget a step. With
`prefill_share` set instead, the pieces keep the step's predicted cost within
that share over theirs, a token at least: the streams' inter-token gaps stay
smooth, and the prompt takes the rest of the machine only once they end. Its
first token comes much later: on a 2-core CPU, past a few hundred tokens of
context one token of it costs more than a quarter of the streams' step, so
at 0.25 a 2,560-token prompt beside three streams moved a token a step (up
to 50 s against 1.9 s).

Preemption: when pages run out for a running request, the lowest-class, most
recently admitted one goes (the end of `running`). Before that, a waiting
request that outranks running ones and would not fit takes their room: the
lower-class running requests are preempted, lowest first, until it fits. A
preempted request's pages are freed and it goes back to the head of its queue
to be recomputed, which reproduces the same tokens. A request that waits past
its class's `max_queue_s` without being admitted is refused (`plan.rejected`);
while a high request has waited `shed_low_after_s`, queued low requests are
refused too (`plan.shed`).

Time-bounded steps: a step runs to its end, so a request of a higher class
that arrives mid-step waits for it, and shares the next. The highest class
present (waiting, running, or gone less than `step_budget_hold_s` ago) is
the step's top class; its work (running requests, then waiting ones while
the queue's head is of it) is planned first, under the token budget only.
Lower classes' work comes after, each request cut to what keeps the step's
planned cost within the top class's `step_budget_ms` (auto: in one of
LOWER_JOIN_EVERY steps with the top class's own work, that work plus one step
of one decode, as last measured, and nothing in the others; a few lone
decodes while the top class is present by its hold only; `engine/step_cost.py`
predicts a step's seconds from its prefill tokens, decodes and the context
they attend over, as measured, per regime in a quantized mode):
their prefill is chunked finer, and their decodes skip a step when even one
does not fit. In one of LOWER_JOIN_EVERY steps the first lower request gets
a page of its prompt (or its decode) even if nothing of it fits: a long
prompt's chunk attends over its own growing context and came to cost more
than the limit however small, and while the top class stayed present it
never moved again. When nothing of a lower class is present, nothing is
cut: with one class only, steps are as large as the token budget makes them
(but for a restored prompt's rest, above).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtierd.cache.block_hash import BlockHash, BlockHashes
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.page_tables import Allocation
from kvtierd.cache.prefix_lookup import NO_HIT
from kvtierd.engine.config import QOS_CLASSES, QosConfig
from kvtierd.engine.qos_queue import QosQueue, TenantKey
from kvtierd.engine.request import Request
from kvtierd.engine.step_cost import StepCostModel, StepShape

RANK = {c: i for i, c in enumerate(QOS_CLASSES)}  # 0: high
# Auto budget while the top class is present by its hold only (none of its requests waiting, loading or
# running): a step may cost this many lone decodes. A request of it that arrives waits for the step in
# flight, so its TTFT grows by at most that much (a lone decode is ~a tenth of an unloaded TTFT through the
# daemon), and no stream of it has inter-token gaps to keep. Measured with `bench qos` (Zen 5): 4 left the
# low class 25% of its throughput without QoS, 12 gave it 74%; with LOWER_JOIN_EVERY, 16 gave 78-87% at high
# TTFT p95 2.1-2.4x unloaded (two runs), 20 gives 82-92% at 2.0-2.7x (three runs: the machine's speed drifts).
HELD_STEP_DECODES = 20
# While the top class has work of its own, the lower classes join one of this many of its steps (the others
# carry its work alone). Each step they join adds a cost they use poorly (a few decodes: ~0.3 tokens a ms,
# against ~1.4 in a held step's larger batch) and stretches the top class's inter-token gap; its requests end
# sooner without them, and the time they leave goes to held steps. Measured with `bench qos` (Zen 5): joining
# every step, 30% of the flood's time went to top-class steps that gave the low class 4% of its tokens.
LOWER_JOIN_EVERY = 4
# A request whose prefix was loaded from below computes the rest of its prompt in pieces while others decode,
# each piece adding at most this share to their step's predicted cost. In one piece, the 16 tokens past a
# 2,544-token loaded prefix cost the streams' step 42-55 ms against 11 (`bench stall`, Zen 5): each new token
# attends over the whole loaded context.
RESTORED_STEP_SHARE = 0.2
# ... in at most this many pieces, which bounds what pacing adds to its TTFT: a longer rest (a long new message
# after a restored history, or a load that missed its deadline and recomputes) goes in full chunks.
RESTORED_MAX_PIECES = 32
# A cached prompt's last token whose attention over its context would add at least this share to the step of the
# decodes it joins is split by layers: the first half of them in that step, the rest in the next (a split join).
# Its context's K/V are read over two steps, not in one: a 2,560-token context took three streams' step from
# 11.9 to 18.4 ms whole, to 15.5 and 15.0 split (`bench join`, 2 threads, AMD EPYC).
JOIN_SPLIT_SHARE = 0.15
LOADING = -1  # what `_admit` returns for a request that started loading its prefix instead


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    allocation: Allocation
    context_len: int  # its tokens in the cache after the step: what its attention reads
    join_half: int = 0  # a split join's part: 1, its token through the first half of the layers; 2, the rest


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

    @property
    def shape(self) -> StepShape:
        # A split join's part reads its context in half the layers.
        return StepShape(sum(s.num_new_tokens for s in self.prefills), len(self.decodes),
                         sum(s.context_len // 2 if s.join_half else s.context_len for s in self.scheduled))


@dataclass(slots=True)
class _StepRoom:
    """What is left of the step being planned."""

    tokens: int
    top: str  # the highest class present: its work is never cut
    limit_s: float | None = None  # the planned cost lower classes' work must keep within; None: no limit
    lower_floor: bool = False  # the first lower request still moves by a page if nothing of it fits the limit
    admitting: bool = True  # False once memory ran short (or high found no room): nobody more is admitted
    planned: set[str] = field(default_factory=set)  # request ids in the plan


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_prefix_caching: bool = True, qos: QosConfig | None = None,
                 step_cost: StepCostModel | None = None, clock: Callable[[], float] = time.monotonic,
                 prefill_share: float = 0.0, prefill_chunk_beside_decodes: int = 0) -> None:
        qos = qos or QosConfig()
        self.kv = kv
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefill_share = prefill_share  # what a prefill may add to a step of decodes, of their cost (0: off)
        self.prefill_chunk_beside_decodes = prefill_chunk_beside_decodes  # a prefill's tokens a step beside them
        self.join_split_share = JOIN_SPLIT_SHARE  # a one-token piece adding this share to its decodes' step splits
        self.decoding = StepShape()  # the last plan's decodes: a prefill now would go beside them
        self.max_queue_s: Mapping[str, float] = qos.max_queue_s
        self.shed_low_after_s = qos.shed_low_after_s
        self.step_budget_ms: Mapping[str, float | None] = qos.step_budget_ms
        self.step_budget_hold_s = qos.step_budget_hold_s
        self.step_cost = step_cost or StepCostModel()
        self._clock = clock
        self._last_present: dict[str, float] = {}  # class -> when a request of it was last waiting or running
        self._own_steps = 0  # steps planned with the top class's own work: one in LOWER_JOIN_EVERY takes the lower classes
        self.waiting = QosQueue(qos.weights, qos.aging_s, clock)
        self.running: list[Request] = []  # highest class first, then in admission order
        self.loading: list[Request] = []  # out of the queue while their prefix loads from below

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def remove(self, request: Request) -> None:
        """Drops a finished or aborted request and frees its pages at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.loading:
            self.loading.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id, finished=True)  # a loading request's loads are abandoned

    def schedule(self) -> StepPlan:
        plan = StepPlan(rejected=self.waiting.timed_out(self.max_queue_s),
                        shed=self.waiting.shed_low(self.shed_low_after_s))
        self.collect_loaded()
        room = _StepRoom(self.max_num_batched_tokens, self._top_class())
        first = self._make_room_for_waiting(plan, room.tokens)
        # Admitted before the running ones are served, or they would take the room just made (one of a class
        # below the top one is admitted with its class, within the step's time limit).
        if first is not None and not self._is_lower(first, room):
            self._admit(first, plan, room)
        inflight = self._inflight_hashes() if self.enable_prefix_caching and self.waiting else set()
        no_room: set[str] = set()  # classes that found no pages (or no time) this step
        deferred: set[TenantKey] = set()  # tenants whose next request waits for a prefix being computed
        # The top class's work first, under the token budget only; then the lower classes', within the time limit.
        for lower in (False, True):
            if lower:
                room.limit_s, room.lower_floor = self._limit_s(room.top, plan.shape)
            self._serve_running(plan, room, lower)
            self._admit_waiting(plan, room, lower, inflight, no_room, deferred)
        self._split_joins(plan)
        self.decoding = StepShape(0, len(plan.decodes), sum(s.context_len for s in plan.decodes))
        return plan

    def _split_joins(self, plan: StepPlan) -> None:
        """Marks the plan's split joins: a request whose prompt's last token went through the first half of the
        layers last step takes the rest now; one whose last token is due now, beside running decodes, and
        whose context would cost their step `join_split_share` or more, goes through the first half now."""
        for s in plan.decodes:
            if s.request.join_hidden is not None:  # whether or not the streams it joined are still running
                s.join_half = 2
        streams = [s for s in plan.decodes if s.request.num_output_tokens and not s.join_half]
        if not streams:
            return
        cost = self.step_cost.current
        streams_s = cost.seconds(StepShape(0, len(streams), sum(s.context_len for s in streams)))
        context_token_s = cost.regime(plan.shape).context_token_s
        for s in plan.decodes:  # a prompt's last token only: a room of one token cuts a prefill to one as well
            if not s.join_half and not s.request.num_output_tokens and s.request.num_pending_tokens == 1 and \
                    context_token_s * s.context_len >= self.join_split_share * streams_s:
                s.join_half = 1

    def _serve_running(self, plan: StepPlan, room: _StepRoom, lower: bool) -> None:
        """Plans the pending tokens of the running requests of the top class (or, `lower`, of the classes
        below it) that are not planned yet, their decodes first (a prefill beside them is sized by what they
        cost); preempts from the end of `running` when pages run out."""
        for decodes in (True, False):
            i = 0
            while i < len(self.running) and room.tokens > 0:
                req = self.running[i]
                i += 1
                if req.request_id in room.planned or self._is_lower(req, room) != lower or \
                        (req.num_pending_tokens == 1) != decodes:
                    continue
                n = self._num_new_tokens(req, plan, room)
                if n == 0:
                    continue  # the time is spent for it; a decode of another may still fit
                alloc = self._slots(req, n)
                while alloc is None:
                    room.admitting = False  # memory is short: admit nobody
                    victim = self._pop_victim(room.planned)
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is req:
                        return  # the ones after it went first
                    alloc = self._slots(req, n)
                self._add_to_plan(plan, room, ScheduledRequest(req, n, alloc, req.num_computed_tokens + n))

    def _slots(self, req: Request, n: int) -> Allocation | None:
        """Slots for the next `n` tokens of running `req`: those it has, for a split join's second part."""
        if req.join_hidden is not None:
            return self.kv.allocated_slots(req.request_id, req.num_computed_tokens, n)
        return self.kv.allocate_slots(req.request_id, n)

    def _admit_waiting(self, plan: StepPlan, room: _StepRoom, lower: bool, inflight: set[BlockHash],
                       no_room: set[str], deferred: set[TenantKey]) -> None:
        """Admits waiting requests in the queue's order; before `lower`, only while its head is of the top class."""
        while room.admitting and room.tokens > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek(no_room, deferred)
            if req is None or (not lower and self._is_lower(req, room)):
                return
            if inflight and not inflight.isdisjoint(self._prompt_hashes(req)):
                deferred.add((req.qos_class, req.cache_root))  # its prefix is being computed: wait and reuse it
                continue
            n = self._admit(req, plan, room)
            if n == LOADING:
                continue
            if n == 0:  # the step's time is spent for its class; a top-class request behind it (aged past) goes
                no_room.add(req.qos_class)
                continue
            if n is None:
                if req.high:
                    room.admitting = False  # the reserve is open to high: nobody else would fit either
                    return
                no_room.add(req.qos_class)
                continue
            if self.enable_prefix_caching:
                inflight.update(self._pending_prompt_hashes(req))

    def _admit(self, req: Request, plan: StepPlan, room: _StepRoom) -> int | None:
        """Starts a waiting request with its cached prefix and first chunk; the tokens it took, or (nothing
        changes) None when its class finds no room, 0 when the step's time is spent, LOADING when its
        prefix started loading from below (it left the queue until it is loaded)."""
        if not self._adopt_cached_prefix(req):
            self.waiting.remove(req)
            self.loading.append(req)
            return LOADING
        n = self._num_new_tokens(req, plan, room)
        alloc = self.kv.allocate_slots(req.request_id, n, req.high) if n else None
        if alloc is None:
            self.kv.free(req.request_id)  # the adopted pages go back to the cache
            req.num_computed_tokens = 0
            return 0 if n == 0 else None
        self.waiting.admitted(req, req.num_pending_tokens)
        self._start_running(req)
        self._add_to_plan(plan, room, ScheduledRequest(req, n, alloc, req.num_computed_tokens + n))
        return n

    def _num_new_tokens(self, req: Request, plan: StepPlan, room: _StepRoom) -> int:
        """Its pending tokens, within the token budget, in pieces beside the decodes planned (`_beside_decodes`),
        and, for a class below the top one, within the time limit."""
        n = min(req.num_pending_tokens, room.tokens)
        if n > 1 and plan.decodes:
            n = self._beside_decodes(req, plan, n)
            if n == 0:
                return 0
        if room.limit_s is None or not self._is_lower(req, room):
            return n
        cost = self.step_cost.current
        if n == 1:
            shape = plan.shape.plus(num_decodes=1, num_context_tokens=req.num_computed_tokens + 1)
            fits = 1 if cost.seconds(shape) <= room.limit_s else 0
        else:
            fits = min(n, cost.prefill_tokens_within(plan.shape, room.limit_s, req.num_computed_tokens))
        # A step that would carry nothing still moves: a limit below the fixed overhead cannot stall the engine;
        # nor can it starve the lower classes: a step of theirs (one of LOWER_JOIN_EVERY) moves them a page at least.
        floor = plan.empty or room.lower_floor
        room.lower_floor = False
        return fits or (min(n, self.kv.block_size) if floor else 0)

    def _beside_decodes(self, req: Request, plan: StepPlan, n: int) -> int:
        """How many of the `n` pending prompt tokens of `req` go beside the decodes planned. While decodes of
        its class or a higher one are planned: with `prefill_share` set, the most that keep the step within that
        share over their cost (one at least, unless another prefill took the room first); else at most
        `prefill_chunk_beside_decodes` (when set). Then, for a prefix loaded from below: its rest within
        RESTORED_STEP_SHARE, when RESTORED_MAX_PIECES such pieces suffice; any other prompt: all of them."""
        guarded = any(RANK[s.request.qos_class] <= RANK[req.qos_class] for s in plan.decodes)
        if guarded and self.prefill_share > 0:
            return self._piece(req, plan, n, self.prefill_share, floor=0 if plan.prefills else 1)
        if guarded and self.prefill_chunk_beside_decodes:
            n = min(n, self.prefill_chunk_beside_decodes)
        if req.prefix_loaded and any(req.tokens_from_below.values()):
            k = self._piece(req, plan, n, RESTORED_STEP_SHARE, floor=1)
            return k if req.num_prompt_tokens - req.num_computed_tokens <= RESTORED_MAX_PIECES * k else n
        return n

    def _piece(self, req: Request, plan: StepPlan, n: int, share: float, floor: int) -> int:
        """The most of the `n` pending prompt tokens of `req` that keep the step's predicted cost within
        (1 + `share`) times its decodes' alone, and at least `floor`."""
        cost = self.step_cost.current
        cached = req.num_computed_tokens
        decodes = StepShape(0, len(plan.decodes), sum(s.context_len for s in plan.decodes))
        limit_s = (1 + share) * cost.seconds(decodes)
        others = plan.shape

        def fits(k: int) -> bool:
            # The fit charges a sequence's context once (a decode's one query); each new token attends over it.
            shape = others.plus(num_prefill_tokens=k, num_context_tokens=cached + k)
            return cost.seconds(shape) + (k - 1) * cost.regime(shape).context_token_s * cached <= limit_s

        lo, hi = floor, n  # the most that fit lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _is_lower(self, req: Request, room: _StepRoom) -> bool:
        return RANK[req.qos_class] > RANK[room.top]

    def _top_class(self) -> str:
        """The highest class waiting, running, or gone less than step_budget_hold_s ago."""
        now = self._clock()
        for req in (*self.running, *self.waiting):
            self._last_present[req.qos_class] = now
        present = [c for c, t in self._last_present.items() if now - t <= self.step_budget_hold_s]
        return min(present, key=RANK.__getitem__, default=QOS_CLASSES[-1])

    def _limit_s(self, top: str, own: StepShape) -> tuple[float | None, bool]:
        """The step's limit for lower classes' work, the top class's being planned (`own`) (None when off), and
        whether the first lower request moves by a page even if nothing of it fits: in one of LOWER_JOIN_EVERY
        steps, and in every step while the top class is present by its hold only.

        Auto: in one of LOWER_JOIN_EVERY steps, lower classes add at most what a step of one decode costs (a
        lone request's inter-token latency) to the top class's own work, or to one such step when it has none;
        the other steps are the top class's alone. An added cost, not a multiple: a busy top class does not
        hand the others more (its latency would feed on itself), nor starve them. While the top class is
        present by its hold only, a step may cost HELD_STEP_DECODES lone decodes."""
        budget_ms = self.step_budget_ms[top]
        one_decode = self.step_cost.one_decode_s
        if budget_ms is None and not any(r.qos_class == top for r in (*self.running, *self.waiting, *self.loading)):
            return HELD_STEP_DECODES * one_decode, True
        self._own_steps += 1
        join = self._own_steps % LOWER_JOIN_EVERY == 0
        if budget_ms is not None:
            return budget_ms / 1e3 or None, join
        own_s = self.step_cost.current.seconds(own) if own.num_tokens > 1 else one_decode
        if not join:
            return own_s, False
        return max(own_s, one_decode) + one_decode, True

    def _pop_victim(self, planned: set[str]) -> Request:
        """The last running request not in the plan yet."""
        j = max(j for j, r in enumerate(self.running) if r.request_id not in planned)
        return self.running.pop(j)

    def _make_room_for_waiting(self, plan: StepPlan, budget: int) -> Request | None:
        """Preempts lower-class running requests, lowest first, until the request next in line fits
        (its first chunk's pages, counted without cache hits; a seat if max_num_seqs are running).
        Returns it when it preempted for it: it is admitted first. The request is the highest waiting class's
        next one, even when a lower one aged past it: aging orders admission, it does not take pages from
        the classes it outranks."""
        top = min((r.qos_class for r in self.waiting), key=RANK.__getitem__, default=None)
        req = self.waiting.peek([c for c in QOS_CLASSES if top is not None and RANK[c] > RANK[top]])
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

    def _hashes(self, req: Request) -> BlockHashes:
        if req.block_hashes is None:  # made when the engine added it; here for requests queued directly
            req.block_hashes = self.kv.hashes(req.cache_root)
        return req.block_hashes

    def _prompt_hashes(self, req: Request) -> list[BlockHash]:
        return self._hashes(req).of_full_pages(req.prompt_token_ids)

    def _pending_prompt_hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the prompt pages `req` has yet to compute (and index)."""
        return self._prompt_hashes(req)[len(self.kv.table(req.request_id).block_hashes) :]

    def _inflight_hashes(self) -> set[BlockHash]:
        """Prompt pages running requests are computing now. A waiting request that
        shares one waits for it instead of computing the same pages privately."""
        return {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
                for h in self._pending_prompt_hashes(r)}

    def _adopt_cached_prefix(self, req: Request) -> bool:
        """Starts `req`'s page table with its cached prefix; False (and nothing adopted) when its prefix
        started loading from below instead."""
        kv, restore, loaded = self.kv, None, req.loaded
        if loaded is not None:  # its loads arrived (or its deadline passed): what came is cached now
            restore, req.loaded, req.prefix_loaded = loaded.plan, None, True
        hit = NO_HIT
        if self.enable_prefix_caching:
            # Its pages in the index are looked up (and their tokens checked) once for this admission.
            device = kv.device_hit(req.cache_root, req.token_ids, self._hashes(req))
            if not req.prefix_loaded:
                restore = kv.look_below(req.request_id, req.cache_root, req.token_ids, req.high, device=device)
                if kv.loading is not None and req.request_id in kv.loading:
                    return False  # its lookup (and loads) run off the step: it waits in `loading`
            hit = kv.find_prefix(req.cache_root, req.token_ids, req.session_id, below=False,
                                 hashes=self._hashes(req), device=device)
        hit = kv.adopt_prefix(req.request_id, hit, req.tag, req.high)
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:  # what the client is told: the first admission's hit
            req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens)
            req.cache_source = hit.source
            req.tokens_from_below = loaded.tokens_kept(hit.num_tokens, kv.block_size) if loaded else {}
            req.restore = restore or hit.restore
            req.first_scheduled_time = time.monotonic()
        return True

    def collect_loaded(self) -> None:
        """Requests whose loads arrived (or whose deadline passed) go back to the head of their queue. What they
        loaded is indexed now and they let go of every page: queued, a request holds none, like any other. Call
        between steps (each schedule does first; the engine also right after lending the loads time, so a load that
        landed in the lend is indexed there, not in the step that admits it). Its loaded prefix stays cached (used
        last, so evicted last) for its admission to adopt. Were the pages held until then, loaded requests could hold
        them all while the first one waits for one more page to compute its rest, and none would ever be admitted."""
        self.kv.reap_loads()
        for req in reversed([r for r in self.loading if self.kv.load_ready(r.request_id)]):  # in their order
            self.loading.remove(req)
            req.loaded = self.kv.finish_load(req.request_id)
            self.waiting.add(req, front=True)

    def _add_to_plan(self, plan: StepPlan, room: _StepRoom, s: ScheduledRequest) -> None:
        # Any single new token attends like a decode, whatever its phase.
        (plan.decodes if s.num_new_tokens == 1 else plan.prefills).append(s)
        room.tokens -= s.num_new_tokens
        room.planned.add(s.request.request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.join_hidden = None  # a split join's first part is lost with its pages
        req.prefix_loaded = False  # what it lost may be below now: its next admission may load it
        req.num_preemptions += 1
        self.waiting.add(req, front=True)
