"""Runs the engine's step loop beside an asyncio event loop.

Each step runs on one worker thread, so the event loop keeps serving while the
model computes. The engine is only ever touched by that thread during a step
and by the event loop between steps: requests added or cancelled mid-step are
applied as soon as the step returns, so a cancelled request's pages are free
before the next step is scheduled, and a request that arrived during a step is
in the next one's `schedule()` (the loop yields once between steps, so handlers
whose requests landed at the boundary add them first). When the engine goes idle, the step thread
does the engine's idle work (`LLMEngine.on_idle`: compaction, saving ahead);
edits made meanwhile wait for it as they wait for a step. The loop tells the
tiers' background work whether the engine has steps to run, so the lower
tiers' writes wait for its idle spells (tiers/background_work.py); a stopped
engine is idle.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvtierd.cache.retention import Retention
from kvtierd.engine.errors import EngineStoppedError, OverloadedError
from kvtierd.engine.llm_engine import LLMEngine
from kvtierd.engine.request import FinishReason, RequestOutput
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.kernels.torch_threads import step_executor
from kvtierd.tiers.background_work import BACKGROUND_WORK

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        """`executor`: the one thread the engine computes on (`step_executor`), the one it was built on."""
        self.engine = engine
        self._executor = executor or step_executor()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list[Callable[[], None]] = []  # engine edits made while a step runs
        self._stepping = False
        self._idle_work_due = False  # a step ran since the engine was last idle
        self._has_steps = False  # as BACKGROUND_WORK was last told
        self._computes = False  # likewise: it has running requests
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="kvtierd-engine-loop")

    async def stop(self) -> None:
        self._stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for q in list(self._queues.values()):
            q.put_nowait(EngineStoppedError("the engine stopped"))
        self._executor.shutdown(wait=True)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, tenant: str = "",
        session_id: str | None = None, tag: str | None = None, qos_class: str = "normal",
        retention: Retention | None = None, validated: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; leaving the iteration early cancels it.

        Invalid requests raise RequestError here, before anything is queued; one that
        waits past its class's max_queue_s, or is shed, raises OverloadedError."""
        if self._stopped:
            raise EngineStoppedError("the engine is shutting down")
        if not validated:  # `validated`: the caller checked it with `LLMEngine.validate` (it is checked once)
            self.engine.validate(prompt_token_ids, params, qos_class)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._edit(lambda: self._add(queue, prompt_token_ids, params, request_id, tenant, session_id, tag, qos_class,
                                     retention))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._edit(lambda: self.engine.abort_request(request_id))

    def _add(self, queue: asyncio.Queue, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
             tenant: str, session_id: str | None, tag: str | None, qos_class: str,
             retention: Retention | None = None) -> None:
        try:
            self.engine.add_request(prompt_token_ids, params, request_id, tenant, session_id, tag, qos_class,
                                    retention, validated=True)
        except Exception as e:  # reaches the caller instead of leaving it waiting
            queue.put_nowait(e)

    async def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the engine between steps and returns its result."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

        self._edit(run)
        return await future

    def _edit(self, change: Callable[[], None]) -> None:
        if self._stepping:
            self._pending.append(change)
        else:
            change()
        self._wake.set()

    @staticmethod
    def _apply(change: Callable[[], None]) -> None:
        # A deferred change that fails must not take the step loop down with it;
        # requests are validated before they get here, so this is a bug if seen.
        try:
            change()
        except Exception:
            log.exception("deferred engine change failed")

    async def _run(self) -> None:
        try:
            await self._step_while_running()
        finally:
            self._tell_has_steps(False)
            self._tell_computes(False)

    def _tell_has_steps(self, has: bool) -> None:
        if has != self._has_steps:
            self._has_steps = has
            BACKGROUND_WORK.engine_has_steps(has)

    def _tell_computes(self, computes: bool) -> None:
        if computes != self._computes:
            self._computes = computes
            BACKGROUND_WORK.engine_computes(computes)

    async def _step_while_running(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            has_steps = self.engine.has_unfinished()
            self._tell_has_steps(has_steps)
            self._tell_computes(bool(self.engine.scheduler.running))  # a lone request's loads go at full speed
            if not has_steps:
                if self._idle_work_due:  # a slice at a time: a request arriving meanwhile is stepped next
                    self._idle_work_due = await self._idle_work()
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(0)  # requests that arrived as the last step ended join this one
            self._stepping = True
            self._idle_work_due = True
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # a failed step fails its requests, not the daemon
                log.exception("engine step failed")
                outputs = []
                self._fail_all(e)
            finally:
                self._end_stepping()
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    refused = out.finish_reason in (FinishReason.REJECTED, FinishReason.SHED)
                    q.put_nowait(self._overloaded(out.finish_reason) if refused else out)

    async def _idle_work(self) -> bool:
        """A slice of the idle engine's work, on the step thread like a step; True while more is due."""
        self._stepping = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.on_idle)
        except Exception:  # e.g. no device memory for a compaction's copy (nothing moved then): the loop goes on
            log.exception("the engine's idle work failed")
            return False
        finally:
            self._end_stepping()

    def _end_stepping(self) -> None:
        """Applies the engine edits made while the step thread worked."""
        self._stepping = False
        pending, self._pending = self._pending, []
        for change in pending:
            self._apply(change)

    def _overloaded(self, reason: FinishReason) -> OverloadedError:
        # Retry when about a queue's worth of work may have drained: the high class's wait limit.
        retry = max(1, round(self.engine.config.qos.max_queue_s["high"] or 5))
        if reason is FinishReason.SHED:
            return OverloadedError("kvtierd is overloaded: low-priority requests are shed while high-priority ones "
                                   "wait for KV pages; retry later", retry)
        return OverloadedError("kvtierd is overloaded: the request waited past its priority's max_queue_s "
                               "without getting KV pages; retry later", retry)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(error)
