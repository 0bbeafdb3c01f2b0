"""The synchronous engine: add requests, call `step()`, collect outputs.

`AsyncEngine` wraps it for the server; tests, benchmarks and `kvtierd generate`
drive it directly.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kvtierd.cache.block_hash import namespace_root
from kvtierd.cache.kv_cache_manager import KVCacheManager, SessionView
from kvtierd.engine.config import EngineConfig
from kvtierd.engine.errors import RequestError
from kvtierd.engine.model_runner import ModelRunner
from kvtierd.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from kvtierd.engine.sampler import sample, token_logprobs
from kvtierd.engine.sampling_params import SamplingParams

# The tenant name of the public namespace; real tenants are user names or
# header values of [A-Za-z0-9._@:-], so no tenant can be called this.
PUBLIC_NAMESPACE = "<public>"
from kvtierd.engine.scheduler import Scheduler, StepPlan
from kvtierd.model.detokenizer import IncrementalDetokenizer
from kvtierd.model.loader import LoadedModel
from kvtierd.storage.device_pool import DeviceKVPool
from kvtierd.storage.geometry import KVGeometry
from kvtierd.tiers.tier_manager import TierManager, TierStats


@dataclass(slots=True)
class EngineCounters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    host_tokens: int = 0  # of those, loaded from the host tier
    disk_tokens: int = 0  # ... and from the disk tier
    generated_tokens: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class StepStats:
    num_tokens: int
    num_seqs: int
    forward_s: float  # model forward + logits
    total_s: float  # the whole step, scheduling and sampling included


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        mc = loaded.config
        self.geometry = KVGeometry(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, loaded.model.dtype)
        num_blocks = self.geometry.num_blocks_for_budget(config.kv_cache_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no page of {self.geometry.bytes_per_block} bytes"
            )
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.pool = DeviceKVPool(self.geometry, num_blocks, loaded.model.device)
        self.namespaces: dict[bytes, str] = {}  # cache root -> tenant, for reports
        self.tiers = TierManager(config.tiers, self.pool) if config.tiers is not None else None
        self.kv = KVCacheManager(num_blocks, config.block_size, config.eviction_policy, config.prefix_ttl_s,
                                 hash_algorithm=config.hash_algorithm,
                                 prefix_min_hits_per_hour=config.prefix_min_hits_per_hour,
                                 session_idle_ttl_s=config.session_idle_ttl_s,
                                 public_root=self._root(PUBLIC_NAMESPACE), tiers=self.tiers)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.enable_prefix_caching)
        self.runner = ModelRunner(loaded.model, self.pool, self.kv)
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self.counters = EngineCounters()
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
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
        if total > self.kv.capacity_tokens():
            raise RequestError(
                f"prompt + max_tokens ({total} tokens) can never fit the KV cache of {self.kv.capacity_tokens()} "
                "tokens; raise kv_cache_bytes",
                "max_tokens",
            )

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, tenant: str = "",
        session_id: str | None = None, tag: str | None = None,
    ) -> str:
        """Queues a request; its KV is shared only with requests of the same tenant (and
        public prefixes are shared with all). A request of a session starts from the
        session's context pool and leaves its own there; `tag` marks its prefix's pages."""
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.loaded.tokenizer, list(params.stop)),
            arrival_time=time.monotonic(),
            cache_root=self._root(tenant),
            session_id=session_id,
            tag=tag,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters.requests += 1
        self.counters.prompt_tokens += req.num_prompt_tokens
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Cancels a request and frees its pages now."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.finish_reason = FinishReason.ABORT
            self._keep_session(req)  # what it computed is valid KV for the session's next turn
            self.scheduler.remove(req)

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

    def _root(self, tenant: str) -> bytes:
        root = namespace_root(self.loaded.fingerprint, tenant, self.config.hash_algorithm)
        self.namespaces.setdefault(root, tenant)
        return root

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.kv.expire()  # bounded; a lookup also refuses an expired page by itself
        plan = self.scheduler.schedule()
        # Pages evicted while scheduling still hold their KV: saved below now, before the forward reuses them.
        self.kv.demote_evicted()
        if plan.empty:
            return []
        t1 = time.perf_counter()
        sample_idx, logits = self.runner.execute(plan)
        t2 = time.perf_counter()
        outputs = self._advance(plan, sample_idx, logits)
        t3 = time.perf_counter()
        self.last_step = StepStats(plan.num_tokens, len(plan.scheduled), t2 - t1, t3 - t0)
        return outputs

    def _advance(self, plan: StepPlan, sample_idx: list[int], logits) -> list[RequestOutput]:
        scheduled = plan.scheduled
        self.counters.preemptions += len(plan.preempted)
        for s in scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.commit(req.request_id, req.cache_root, req.token_ids, req.num_computed_tokens, req.tag)
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
        p = req.params
        text = req.detokenizer.push(token)
        if req.detokenizer.stopped or token in p.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif not p.ignore_eos and token in self.loaded.tokenizer.eos_token_ids:
            req.finish_reason = FinishReason.STOP
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = FinishReason.LENGTH
        if req.finished:
            text += req.detokenizer.flush()
            self._keep_session(req)
            if req.session_id is not None and self.config.enable_prefix_caching:
                # The turn outlives a restart or a crash: copied out now, written by the disk tier's thread.
                self.kv.write_through(req.request_id, req.cache_root, req.token_ids)
            del self.requests[req.request_id]
            self.scheduler.remove(req)
        return RequestOutput(
            request_id=req.request_id,
            token_ids=[token],
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
        )

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


def _by_tier(req: Request) -> dict[str, int]:
    host, disk = req.tokens_from_below.get("host", 0), req.tokens_from_below.get("disk", 0)
    return {"device": max(req.num_cached_tokens, 0) - host - disk, "host": host, "disk": disk}
