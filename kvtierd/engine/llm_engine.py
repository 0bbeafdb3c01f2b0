"""The synchronous engine: add requests, call `step()`, collect outputs.

`AsyncEngine` wraps it for the server; tests, benchmarks and `kvtierd generate`
drive it directly.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.cache_shares import CacheShares
from kvtierd.cache.compaction import CompactionResult
from kvtierd.cache.kv_cache_manager import KVCacheManager
from kvtierd.cache.pins import Pin
from kvtierd.cache.reserved_region import ReservedRegion
from kvtierd.cache.retention import Retention
from kvtierd.cache.session_cache import SessionView
from kvtierd.engine.config import QOS_CLASSES, EngineConfig, QosConfig
from kvtierd.engine.errors import RequestError
from kvtierd.engine.model_runner import ModelRunner
from kvtierd.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from kvtierd.engine.sampler import sample, token_logprobs
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.engine.scheduler import Scheduler, StepPlan
from kvtierd.engine.step_cost import StepCostModel
from kvtierd.engine.step_threads import StepThreads
from kvtierd.model.detokenizer import IncrementalDetokenizer
from kvtierd.model.loader import LoadedModel
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry
from kvtierd.tiers.background_work import BACKGROUND_WORK, LEND_SHARE
from kvtierd.tiers.tier_manager import TierManager
from kvtierd.tiers.tier_stats import TierStats

# The tenant name of the public namespace; real tenants are user names or
# header values of [A-Za-z0-9._@:-], so no tenant can be called this.
PUBLIC_NAMESPACE = "<public>"
# How long an idle slice waits for the finished turns' store copies: a request arriving meanwhile waits this
# long at most before its first step.
IDLE_STORE_WAIT_S = 0.005

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCounters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    host_tokens: int = 0  # of those, loaded from the host tier
    disk_tokens: int = 0  # ... from the disk tier
    remote_tokens: int = 0  # ... and from the fleet's remote tier
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0  # requests cancelled before they finished (a client gone, the engine stopping)
    compactions: int = 0
    compacted_pages: int = 0  # live pages moved by compactions
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QOS_CLASSES, 0))  # per class: waited too long
    shed: int = 0  # low requests refused while a high one waited

    @property
    def device_tokens(self) -> int:
        """Cached prompt tokens the device held: the others were loaded from the tiers below, remote included."""
        return self.cached_tokens - self.host_tokens - self.disk_tokens - self.remote_tokens


@dataclass(slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    forward_s: float  # model forward + logits
    total_s: float  # the whole step, scheduling and sampling included
    threads: int  # torch's threads it computed with (one fewer while the tiers' background work ran)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What handlers on the event loop may read at any time: taken by the step thread between steps."""

    running: int = 0
    waiting: int = 0
    loading: int = 0  # waiting for their prefix to load from below
    used_pages: int = 0
    high_pages: int = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        mc = loaded.config
        self.geometry = KVGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, loaded.model.kv_dtype)
        num_blocks = self.geometry.num_blocks_for_budget(config.kv_cache_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no page of {self.geometry.bytes_per_block} bytes"
            )
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.pool = DeviceKVPool(self.geometry, num_blocks, loaded.model.device)
        self.namespaces: dict[bytes, str] = {}  # cache root -> tenant, for reports
        self.cache_shares = CacheShares(config.qos.tenant_cache_weights, config.qos.cache_shares)
        self.tiers = TierManager(config.tiers, self.pool, loaded.fingerprint) if config.tiers is not None else None
        if self.tiers is not None:
            self._share_tiers(config.qos)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.eviction_policy, config.prefix_ttl_s,
                                 hash_algorithm=config.hash_algorithm,
                                 prefix_min_hits_per_hour=config.prefix_min_hits_per_hour,
                                 session_idle_ttl_s=config.session_idle_ttl_s,
                                 public_root=self._root(PUBLIC_NAMESPACE), tiers=self.tiers,
                                 reserve=reserved_region(config.qos, num_blocks),
                                 pin_budget_pages=int(config.qos.pin_share * num_blocks), shares=self.cache_shares)
        # What a step costs, as measured: the scheduler's time-bounded steps. A quantized mode's steps run
        # other kernels past a few tokens (model/llama.py, `step_regimes`): each span has a cost of its own.
        self.step_cost = StepCostModel(regime_max_tokens=loaded.model.step_regimes)
        if self.tiers is not None:  # the restore planner weighs loads against recomputing, as the steps cost
            self.tiers.planner.recompute_cost = self._recompute_s
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.enable_prefix_caching, config.qos, self.step_cost,
                                   prefill_share=config.prefill_share,
                                   prefill_chunk_beside_decodes=config.prefill_chunk_beside_decodes)
        self.runner = ModelRunner(loaded.model, self.pool, self.kv)
        # A core left to loads and stores (to stores, beside short steps only).
        self.step_threads = StepThreads(lambda: BACKGROUND_WORK.busy, lambda: BACKGROUND_WORK.awaited)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.counters = EngineCounters()
        self.snapshot = EngineSnapshot()
        self._ids = itertools.count()
        self._idle_saved: int | None = None  # pages the watermark covered in this idle spell; None: none yet

    def _share_tiers(self, qos: QosConfig) -> None:
        """The host slots and disk bytes are shared by the device's weights, and capped per tenant; so are the
        remote tier's bytes, fleet-wide (its sharing is its TTL and the server's maxmemory policy)."""
        names = self.cache_shares.names
        for store, caps in ((self.tiers.host, qos.tenant_host_bytes), (self.tiers.disk, qos.tenant_disk_bytes),
                            (self.tiers.remote, qos.tenant_remote_bytes)):
            if store is None:
                continue
            if self.cache_shares.enabled and store is not self.tiers.remote:
                store.share_by(self.cache_shares.weight)
            if caps:
                store.limit_by(lambda root, caps=caps: caps.get(names.get(root, ""), caps.get("*")))

    # -- requests -------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos_class: str = "normal") -> None:
        """Raises RequestError for a request that can never be served."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"token ids must be in [0, {vocab})", "prompt")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; the context window is {self.max_model_len}", "messages"
            )
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"window of {self.max_model_len} tokens",
                "max_tokens",
            )
        if qos_class not in QOS_CLASSES:
            raise RequestError(f"priority must be one of {', '.join(QOS_CLASSES)}", "priority")
        capacity = self.kv.capacity_tokens(qos_class == "high")
        if total > capacity:
            raise RequestError(
                f"prompt + max_tokens ({total} tokens) can never fit the KV cache of {capacity} tokens "
                f"({qos_class} priority: the reserved region is high's); raise kv_cache_bytes",
                "max_tokens",
            )

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, tenant: str = "",
        session_id: str | None = None, tag: str | None = None, qos_class: str = "normal",
        retention: Retention | None = None, validated: bool = False,
    ) -> str:
        """Queues a request; its KV is shared only with requests of the same tenant (and
        public prefixes are shared with all). A request of a session starts from the
        session's context pool and leaves its own there; `tag` marks its prefix's pages;
        `qos_class` (high, normal, low) orders admission and preemption; `retention` keeps its pages
        ahead of ordinary ones in eviction for a while (cache/retention.py)."""
        if not validated:  # a caller that validated it already says so: a prompt is checked once
            self.validate(prompt_token_ids, params, qos_class)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        root = self._root(tenant)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.loaded.tokenizer, list(params.stop)),
            arrival_time=time.monotonic(),
            cache_root=root,
            session_id=session_id,
            tag=tag,
            qos_class=qos_class,
            block_hashes=self.kv.hashes(root),  # its tokens are known: each page is hashed once
        )
        self.requests[request_id] = req
        if retention is not None:
            self.kv.retain(request_id, retention)
        self.scheduler.add(req)
        if self.config.enable_prefix_caching:
            # Chunks on disk or remote start moving up now, and its lookup of the lower tiers starts.
            self.kv.prefetch(req.cache_root, req.prompt_token_ids, request_id, req.block_hashes)
        self.counters.requests += 1
        self.counters.prompt_tokens += req.num_prompt_tokens
        self._take_snapshot()
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Cancels a request and frees its pages now."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.finish_reason = FinishReason.ABORT
            self.counters.aborted += 1
            self._keep_session(req)  # what it computed is valid KV for the session's next turn
            self.scheduler.remove(req)
            self._take_snapshot()

    def _keep_session(self, req: Request) -> None:
        if req.session_id is not None and self.config.enable_prefix_caching:
            self.kv.keep_session(req.request_id, (req.cache_root, req.session_id), req.token_ids,
                                 req.num_computed_tokens)

    def session_view(self, session_id: str, tenant: str = "") -> SessionView | None:
        return self.kv.session_view((self._root(tenant), session_id))

    # -- invalidation (each returns the pages unindexed) ---------------------------

    def invalidate_prefix(self, token_ids: list[int], tenant: str = "") -> int:
        return self.kv.invalidate_prefix(self._root(tenant), token_ids)

    def invalidate_session(self, session_id: str, tenant: str = "") -> int:
        return self.kv.invalidate_session((self._root(tenant), session_id))

    def invalidate_tenant(self, tenant: str) -> int:
        return self.kv.invalidate_namespace(self._root(tenant))

    def invalidate_tag(self, tag: str) -> int:
        return self.kv.invalidate_tag(tag)

    def invalidate_hash(self, block_hash: bytes) -> int:
        return self.kv.invalidate_hash(block_hash)

    def invalidate_model(self, fingerprint: str) -> int:
        """Everything cached for a model: all of it when it is the one loaded, else nothing here."""
        return self.kv.invalidate_all() if fingerprint == self.loaded.fingerprint else 0

    # -- pins ----------------------------------------------------------------------

    def pin_prefix(self, pin_id: str, token_ids: list[int], tenant: str = "", ttl_s: float | None = None,
                   tier: str = "device") -> Pin | None:
        """Pins a cached prefix's full pages (or its chunks in the host or disk tier); None when not all are
        cached (compute it first)."""
        return self.kv.pin_prefix(pin_id, self._root(tenant), token_ids, ttl_s, tier)

    def pin_session(self, pin_id: str, session_id: str, tenant: str = "", ttl_s: float | None = None,
                    tier: str = "device") -> Pin:
        return self.kv.pin_session(pin_id, (self._root(tenant), session_id), ttl_s, tier)

    def unpin(self, pin_id: str) -> Pin | None:
        return self.kv.unpin(pin_id)

    def _root(self, tenant: str) -> bytes:
        root = namespace_root(self.loaded.fingerprint, tenant, self.config.hash_algorithm)
        self.namespaces.setdefault(root, tenant)
        self.cache_shares.name(root, "public" if tenant == PUBLIC_NAMESPACE else tenant)
        return root

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._idle_saved = None  # the next idle spell starts its work afresh
        try:
            return self._step()
        finally:
            self._take_snapshot()

    def _take_snapshot(self) -> None:
        s, pool = self.scheduler, self.kv.pool
        self.snapshot = EngineSnapshot(len(s.running), len(s.waiting), len(s.loading), pool.num_used_blocks,
                                       pool.num_high_blocks)

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.kv.expire()  # bounded; a lookup also refuses an expired page by itself
        plan = self.scheduler.schedule()
        # Pages evicted while scheduling still hold their KV: saved below now, before the forward reuses them.
        self.kv.demote_evicted()
        self._observe_reserve()
        rejected = [self._reject(r, FinishReason.REJECTED) for r in plan.rejected] + \
            [self._reject(r, FinishReason.SHED) for r in plan.shed]
        if plan.empty:
            if self.scheduler.loading:  # nothing to compute until a load arrives: wait for one, not spin
                self.kv.wait_for_loads()
            return rejected
        lent_s = self._lend(plan)
        threads = self.step_threads.before_step(lambda: self.step_cost.current.seconds(plan.shape))
        t1 = time.perf_counter()
        sample_idx, logits = self.runner.execute(plan)
        t2 = time.perf_counter()
        outputs = rejected + self._advance(plan, sample_idx, logits)
        t3 = time.perf_counter()
        self.step_cost.observe(plan.shape, t3 - t0 - lent_s)
        self.last_step = StepStats(plan.num_tokens, len(plan.scheduled), t2 - t1, t3 - t0 - lent_s, threads)
        return outputs

    def _lend(self, plan: StepPlan) -> float:
        """Lends paced loads LEND_SHARE of the step's time as the step-cost model predicts it, after scheduling
        and before the forward, never beside it (tiers/background_work.py); returns the seconds it waited. The
        last step's measured time made a slow step's successor lend 10-16 ms (`bench stall`, remote): two
        slow gaps for one. With decodes in the step, the share is of their time alone: a step that also
        computes a prompt (a stream's next request) is the streams' longest gap already, and its share of it
        (17 ms before a 55 ms step, `bench stall` slow Redis) lengthened the very gaps that make their ITL p99.
        A load that lands in the lend is indexed right after it (its request queues) and
        admitted by the next step's scheduling, which lends nothing if no other load is left: the step in
        which a long context's first token joins the batch, the longest of a load's window, is lengthened
        neither by a lend nor by indexing what was loaded (160 pages: 1-2 ms)."""
        if not BACKGROUND_WORK.wants_lend:
            return 0.0
        t = time.perf_counter()
        decodes = self.scheduler.decoding  # this plan's
        lent_of = decodes if decodes.num_decodes else plan.shape
        BACKGROUND_WORK.lend(LEND_SHARE * self.step_cost.current.seconds(lent_of))
        self.scheduler.collect_loaded()
        return time.perf_counter() - t

    def _recompute_s(self, tokens: int) -> float:
        cost, decodes, share = self.step_cost.current, self.scheduler.decoding, self.config.prefill_share
        step_tokens = self.config.max_num_batched_tokens
        if not decodes.num_decodes:
            return cost.prefill_seconds(tokens, step_tokens)
        if share:
            # Beside decodes, a prefill takes `share` of their step's cost each step: it runs (1 + share) / share
            # longer than alone.
            return cost.prefill_seconds(tokens, step_tokens) * (1 + share) / share
        # In steps with the decodes in them, of prefill_chunk_beside_decodes tokens when set: a 2,560-token prompt
        # beside three streams took 3.1 s, estimated at 1.4 s as if alone in 2,048-token steps (`bench stall`).
        chunk = self.config.prefill_chunk_beside_decodes
        return cost.prefill_seconds(tokens, min(step_tokens, chunk) if chunk else step_tokens, decodes)

    def _observe_reserve(self) -> None:
        reserve = self.kv.pool.reserve
        if reserve is not None and reserve.window_s:
            resize = reserve.observe(time.monotonic(), self.kv.pool.num_high_blocks)
            if resize is not None:
                log.info("reserved region resized from %d to %d pages (high's p99 page use: %d)",
                         resize.old_pages, resize.new_pages, resize.p99_pages)

    def _reject(self, req: Request, reason: FinishReason) -> RequestOutput:
        """A request refused unadmitted, REJECTED (it waited past its class's max_queue_s) or SHED (it was
        low while a high one waited): it ends unserved (the server answers 503)."""
        req.finish_reason = reason
        if reason is FinishReason.SHED:
            self.counters.shed += 1
        else:
            self.counters.rejected[req.qos_class] += 1
            # What the operator needs to tell a flood from pages held elsewhere (loads, stores, pins).
            pool = self.kv.pool
            log.warning("%s request %s refused after %.1f s unadmitted: %d of %d pages free to it, %d running, "
                        "%d waiting, %d loading, %d preemptions, prefix loaded: %s", req.qos_class,
                        req.request_id, time.monotonic() - req.arrival_time, pool.num_free_blocks_for(req.high),
                        pool.num_blocks, len(self.scheduler.running), len(self.scheduler.waiting),
                        len(self.scheduler.loading), req.num_preemptions, req.prefix_loaded)
        del self.requests[req.request_id]
        self.scheduler.remove(req)
        return self._output(req, [], "", None)

    def _advance(self, plan: StepPlan, sample_idx: list[int], logits) -> list[RequestOutput]:
        scheduled = plan.scheduled
        self.counters.preemptions += len(plan.preempted)
        for s in scheduled:
            req = s.request
            if s.join_half == 1:
                continue  # its token is computed once the rest of the layers have run, next step
            req.num_computed_tokens += s.num_new_tokens
            self.kv.commit(req.request_id, req.cache_root, req.token_ids, req.num_computed_tokens, req.tag,
                           req.block_hashes)
        if not sample_idx:
            return []
        reqs = [scheduled[i].request for i in sample_idx]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        want = [r.params.top_logprobs if r.params.logprobs else -1 for r in reqs]
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if any(w >= 0 for w in want):
            computed = token_logprobs(logits, tokens, [max(w, 0) for w in want])
            lps = [lp if w >= 0 else None for lp, w in zip(computed, want)]
        return [self._append_token(r, t, lp) for r, t, lp in zip(reqs, tokens, lps)]

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        req.token_ids.append(token)
        self.counters.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.counters.cached_tokens += req.num_cached_tokens
            self.counters.host_tokens += req.tokens_from_below.get("host", 0)
            self.counters.disk_tokens += req.tokens_from_below.get("disk", 0)
            self.counters.remote_tokens += req.tokens_from_below.get("remote", 0)
        p = req.params
        text = req.detokenizer.push(token)
        if req.detokenizer.stopped or token in p.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif not p.ignore_eos and token in self.loaded.tokenizer.eos_token_ids:
            req.finish_reason = FinishReason.STOP
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = FinishReason.LENGTH
        stored_chunks: tuple[bytes, ...] = ()
        if req.finished:
            text += req.detokenizer.flush()
            self._keep_session(req)
            if self.config.enable_prefix_caching and (req.session_id is not None or self.kv.shares_every_request):
                # A turn outlives a restart or a crash (disk), and the fleet may reuse what was computed
                # (remote): copied out now, stored by the tiers' writer threads.
                # Another request reuses a session's whole turn, or a plain request's prompt (not its reply).
                kept = req.token_ids if req.session_id is not None else req.prompt_token_ids
                stored_chunks = self.kv.write_through(req.request_id, req.cache_root, kept,
                                                      session=req.session_id is not None)
            del self.requests[req.request_id]
            self.scheduler.remove(req)
        return self._output(req, [token], text, logprob, stored_chunks)

    def _output(self, req: Request, token_ids: list[int], text: str, logprob: TokenLogprob | None,
                stored_chunks: tuple[bytes, ...] = ()) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=[logprob] if logprob is not None else [],
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            cached_tokens_by_tier=_by_tier(req),
            cache_source=req.cache_source,
            queue_s=(req.first_scheduled_time or req.arrival_time) - req.arrival_time,
            restore=req.restore,
            stored_chunks=stored_chunks,
        )

    # -- compaction -----------------------------------------------------------------

    def compact(self) -> CompactionResult:
        """Moves the live pages together and the free pages into one run (cache/compaction.py). Call
        between two steps only: no forward may be reading the pages while they move."""
        t0 = time.perf_counter()
        plan = self.kv.plan_compaction()
        self.pool.copy_blocks(plan.copies)
        self.kv.apply_compaction(plan)
        self.pool.synchronize()  # the time taken includes the copies
        self.counters.compactions += 1
        self.counters.compacted_pages += len(plan.copies)
        return CompactionResult(len(plan.copies), plan.before, self.kv.fragmentation(), time.perf_counter() - t0)

    def on_idle(self) -> bool:
        """Work for the step thread once no request is left, one slice per call, so a request arriving meanwhile
        waits for one slice at most: first the free-page watermark, a chunk per call: the chunks of the idle
        pages that the next step's allocations would evict (a step's token budget of pages) are saved to the
        host tier now, so those evictions copy nothing; then the finished turns' stores, whose copies out of
        the pages start once the engine has been idle a moment (tiers/background_work.py): a short wait per
        call, and their pages go back; last, with no store reading a page, a compaction if the pages are
        fragmented. True while more is due (call again while idle)."""
        if self._idle_saved is None:  # the first slice of this idle spell
            self._idle_saved = 0
        if self.tiers is not None and self._idle_saved < -(-self.config.max_num_batched_tokens // self.config.block_size):
            self._idle_saved += self.tiers.chunk_pages
            self.kv.save_ahead(self._idle_saved)
            return True
        if self.kv.reap_stores(IDLE_STORE_WAIT_S):
            return True
        self.compact_if_fragmented()
        return False

    def compact_if_fragmented(self) -> CompactionResult | None:
        """Compacts an idle engine whose free-space or sequence fragmentation reached `compact_threshold`."""
        threshold = self.config.compact_threshold
        if not threshold or self.has_unfinished():
            return None
        frag = self.kv.fragmentation()
        if max(frag.free_space, frag.sequence) < threshold:
            return None
        result = self.compact()
        log.info("compacted the KV pages: %d moved in %.1f ms; free-space fragmentation %.2f -> %.2f, "
                 "sequence %.2f -> %.2f", result.pages_moved, result.seconds * 1e3, result.before.free_space,
                 result.after.free_space, result.before.sequence, result.after.sequence)
        return result

    # -- lower tiers ----------------------------------------------------------------

    def flush_tiers(self) -> bool:
        """Queues the KV worth keeping across a restart (sessions, prefixes hit at least once) for the disk
        tier. False when the queue filled first: `tiers.wait()` (off the event loop), then call again."""
        return self.kv.flush_below()

    def tier_stats(self) -> list[TierStats]:
        return self.tiers.stats() if self.tiers is not None else []

    def close(self) -> None:
        """Commits queued disk writes and closes the lower tiers."""
        if self.tiers is not None:
            self.tiers.close()

    # -- convenience ------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Runs prompts to completion together; returns each one's output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.token_ids)
        return [out[i] for i in ids]


def reserved_region(qos: QosConfig, num_blocks: int) -> ReservedRegion | None:
    """The reserved region of a pool of `num_blocks` pages; None when it is off (a fixed share of 0)."""
    if not qos.reserved_share and not qos.reserved_window_s:
        return None
    size = math.ceil(qos.reserved_share * num_blocks)
    if not qos.reserved_window_s:
        return ReservedRegion(size, size, size)
    return ReservedRegion(size, math.ceil(qos.reserved_min_share * num_blocks),
                          math.ceil(qos.reserved_max_share * num_blocks), qos.reserved_window_s)


def _by_tier(req: Request) -> dict[str, int]:
    below = {tier: req.tokens_from_below.get(tier, 0) for tier in ("host", "disk", "remote")}
    return {"device": max(req.num_cached_tokens, 0) - sum(below.values()), **below}
