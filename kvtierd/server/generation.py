"""One request's run through the engine, accumulated into what the API reports."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvtierd.cache.retention import Retention
from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.request import RequestOutput, TokenLogprob
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.server.metrics import RequestObserver
from kvtierd.server.workload import WorkloadRecorder


@dataclass(slots=True)
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"; None while running or when cut off
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0,
                                                                           "remote": 0})
    cache_source: str = "none"  # "session", "prefix", "public" or "none"
    restore: dict | None = None  # chunks found below the device: loaded or recomputed, and the estimates why
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    stored_chunks: tuple[bytes, ...] = ()  # a session turn's chunks on the disk tier, for the SQL catalog

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def kvtierd_info(self, **extra) -> dict:
        """The `kvtierd` extension object: where cached tokens came from, and timings."""
        return {
            "cached_tokens_by_tier": self.cached_tokens_by_tier,
            "cache_source": self.cache_source,
            "restore": self.restore,
            "queue_ms": round(self.queue_ms, 3),
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            **extra,
        }


class Generation:
    def __init__(self, engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, tenant: str,
                 session_id: str | None = None, tag: str | None = None,
                 observer: RequestObserver | None = None, qos_class: str = "normal",
                 workload: WorkloadRecorder | None = None, retention: Retention | None = None) -> None:
        engine.engine.validate(prompt_ids, params, qos_class)  # a bad request fails here, before any response starts
        self._stream = engine.generate(prompt_ids, params, tenant=tenant, session_id=session_id, tag=tag,
                                       qos_class=qos_class, retention=retention, validated=True)
        self._first: RequestOutput | None = None
        self._start = time.monotonic()
        self._observer = observer
        eng = engine.engine
        self._probe = None if workload is None else workload.probe(
            lambda: (eng.snapshot.used_pages, eng.snapshot.high_pages), eng.config.block_size, tenant, session_id,
            qos_class)
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))

    async def first_output(self) -> None:
        """Waits for the first output, so a request refused in the queue (overload) fails before a
        streamed response starts. `outputs()` still yields it."""
        try:
            self._first = await anext(self._stream)
        except BaseException:
            await self._stream.aclose()
            raise

    async def _all(self) -> AsyncIterator[RequestOutput]:
        if self._first is not None:
            yield self._first
        async for out in self._stream:
            yield out

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs, folded into `result` as they pass."""
        r, last = self.result, self._start
        try:
            async for out in self._all():
                now = time.monotonic()
                if r.ttft_ms is None:
                    r.ttft_ms = (now - self._start) * 1e3
                    r.queue_ms = out.queue_s * 1e3
                    r.cached_tokens = out.num_cached_tokens
                    r.cached_tokens_by_tier = dict(out.cached_tokens_by_tier)
                    r.cache_source = out.cache_source
                    r.restore = out.restore.as_dict() if out.restore.num_found else None
                    if self._observer:
                        self._observer.first_output(now - self._start, out.queue_s, r.cached_tokens, r.cache_source)
                elif self._observer:
                    self._observer.next_token(now - last)  # each output carries one token
                last = now
                if self._probe is not None:
                    self._probe.sample()
                r.text += out.text
                r.token_ids.extend(out.token_ids)
                r.logprobs.extend(out.logprobs)
                if out.finished:
                    r.finish_reason = out.finish_reason.value
                    r.stored_chunks = out.stored_chunks
                yield out
        finally:
            await self._stream.aclose()  # leaving early cancels the request and frees its pages
            if self._probe is not None and r.finish_reason is not None:
                self._probe.finish(r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.cached_tokens_by_tier,
                                   r.cache_source)

    async def run(self) -> GenerationResult:
        async for _ in self.outputs():
            pass
        return self.result
