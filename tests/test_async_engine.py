"""The asyncio front of the engine: streaming, cancellation, off-loop stepping."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.errors import RequestError
from kvtierd.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def chat(loaded, text):
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


async def collect(engine: AsyncEngine, prompt, params=GREEDY) -> list[int]:
    return [t async for out in engine.generate(prompt, params) for t in out.token_ids]


def test_concurrent_streams_equal_one_at_a_time(loaded, make_engine):
    prompts = [chat(loaded, f"Give me tip number {i} for caching.") for i in range(5)]
    expected = make_engine().generate(prompts, GREEDY)

    async def main():
        engine = AsyncEngine(make_engine())
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p) for p in prompts))
        finally:
            await engine.stop()

    assert asyncio.run(main()) == expected


def test_steps_run_off_the_event_loop_thread(loaded, make_engine):
    sync_engine = make_engine()
    step_threads = set()
    step = sync_engine.step

    def recording_step():
        step_threads.add(threading.get_ident())
        return step()

    sync_engine.step = recording_step

    async def main():
        engine = AsyncEngine(sync_engine)
        await engine.start()
        await collect(engine, chat(loaded, "hello"))
        await engine.stop()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert step_threads and loop_thread not in step_threads


def test_leaving_the_stream_cancels_and_frees_pages(loaded, make_engine):
    sync_engine = make_engine()
    baseline = sync_engine.kv.num_free_blocks

    async def main():
        engine = AsyncEngine(sync_engine)
        await engine.start()
        stream = engine.generate(chat(loaded, "Write a long essay."), SamplingParams(max_tokens=200, temperature=0.0))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        # Edits made during a step apply in order once it returns: by the time this call runs, the abort has.
        free_now = await engine.call(lambda: sync_engine.kv.num_free_blocks)
        await engine.stop()
        return free_now

    assert asyncio.run(main()) == baseline
    assert not sync_engine.has_unfinished() and sync_engine.counters.aborted == 1


def test_bad_requests_fail_before_anything_is_queued(loaded, make_engine):
    async def main():
        engine = AsyncEngine(make_engine(kv_tokens=64))
        await engine.start()
        try:
            with pytest.raises(RequestError):
                await collect(engine, chat(loaded, "hi"), SamplingParams(max_tokens=500))
            return engine.engine.has_unfinished()
        finally:
            await engine.stop()

    assert asyncio.run(main()) is False
