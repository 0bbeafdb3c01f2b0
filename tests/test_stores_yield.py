"""The lower tiers' writes yield to the engine's steps: a chunk waits while an engine has steps to run and is
written when it goes idle, or once its deferral bound has passed; waiting, it does not count as background
work (the step keeps its threads); closing a writer or stopping the engine lets what waits land."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import torch
from chunk_fixtures import make_identity, make_payload

from kvtierd.engine.async_engine import AsyncEngine
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.storage.disk_store import DiskStore
from kvtierd.tiers.background_work import BACKGROUND_WORK, BackgroundWork
from kvtierd.tiers.chunk_writer import ChunkWriter
from kvtierd.tiers.config import TierConfig

WAIT_S = 60.0  # generous: these waits end on events, never on a clock
FOREVER_S = 3600.0  # a deferral bound no test reaches


def until(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within WAIT_S (it is polled)."""
    end = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)
    return condition()


class EngineSteps:
    """An engine's word to the background work, as AsyncEngine gives it: it has steps, then goes idle."""

    def __init__(self, work: BackgroundWork) -> None:
        self._work = work
        self.has_steps = True
        work.engine_has_steps(True)

    def go_idle(self) -> None:
        if self.has_steps:
            self.has_steps = False
            self._work.engine_has_steps(False)


@pytest.fixture
def engine_steps():
    steps = EngineSteps(BACKGROUND_WORK)
    yield steps
    steps.go_idle()


@pytest.fixture
def disk(tmp_path):
    store = DiskStore(tmp_path, map_size=64 << 20)
    yield store
    store.close()


def chunk(seed: int = 0) -> tuple[bytes, object, torch.Tensor]:
    identity = make_identity(2, seed=seed)
    kv = torch.frombuffer(bytearray(make_payload(identity, seed)), dtype=torch.uint8)
    return identity.block_hashes[-1], identity, kv


def test_a_store_waits_while_the_engine_has_steps_and_is_written_when_it_goes_idle(disk, engine_steps):
    writer = ChunkWriter("disk", disk, "raw", 1 << 20, defer_s=FOREVER_S)
    try:
        key, identity, kv = chunk()
        writer.submit(key, identity, kv)
        assert until(lambda: BACKGROUND_WORK.num_deferred == 1)  # at the gate
        assert not BACKGROUND_WORK.busy  # waiting, it leaves a step every thread
        assert writer.num_written == 0 and disk.contains_prefix([key]) == 0
        assert writer.has(key)  # on its way: not stored again meanwhile
        engine_steps.go_idle()
        writer.wait()
        assert writer.num_written == 1 and disk.contains_prefix([key]) == 1
        assert BACKGROUND_WORK.num_deferred == 0
    finally:
        writer.close()


def test_a_store_is_written_after_its_bound_while_the_engine_stays_busy(disk, engine_steps):
    writer = ChunkWriter("disk", disk, "raw", 1 << 20, defer_s=0.05)
    try:
        key, identity, kv = chunk()
        writer.submit(key, identity, kv)
        writer.run(lambda: None).result(WAIT_S)
        assert engine_steps.has_steps
        assert writer.num_written == 1 and disk.contains_prefix([key]) == 1
    finally:
        writer.close()


def test_closing_a_writer_writes_what_waits_without_waiting_for_the_engine(disk, engine_steps):
    writer = ChunkWriter("disk", disk, "raw", 1 << 20, defer_s=FOREVER_S)
    keys = []
    for seed in range(3):
        key, identity, kv = chunk(seed)
        writer.submit(key, identity, kv)
        keys.append(key)
    assert until(lambda: BACKGROUND_WORK.num_deferred == 1)
    closing = threading.Thread(target=writer.close, daemon=True)
    closing.start()
    closing.join(WAIT_S)
    assert not closing.is_alive() and engine_steps.has_steps
    assert writer.num_written == 3 and disk.contains_prefix(keys) == 3


def test_a_deferred_task_counts_from_its_start_and_a_cancelled_one_never():
    work = BackgroundWork()
    steps = EngineSteps(work)
    pool = work.pool(1, "test-deferred", defer_s=FOREVER_S)
    release = threading.Event()
    try:
        running = pool.submit(release.wait)
        queued = pool.submit(lambda: None)
        assert until(lambda: work.num_deferred == 1)
        assert not work.busy
        assert queued.cancel()
        steps.go_idle()
        assert until(lambda: work.busy)  # started: it counts now
        release.set()
        assert running.result(WAIT_S)
        assert not work.busy and work.num_deferred == 0
        assert not pool.submit(lambda: None).result(WAIT_S)  # an idle engine: no waiting
        assert not work.busy
    finally:
        release.set()
        steps.go_idle()
        pool.shutdown(wait=True)


def test_hurry_starts_the_tasks_waiting_now_and_not_later_ones():
    work = BackgroundWork()
    steps = EngineSteps(work)
    pool = work.pool(1, "test-hurry", defer_s=FOREVER_S)
    waiting = pool.submit(lambda: "written")
    try:
        assert until(lambda: work.num_deferred == 1)
        work.hurry()  # a caller about to wait for it
        assert waiting.result(WAIT_S) == "written"
        later = pool.submit(lambda: "later")
        assert until(lambda: work.num_deferred == 1) and not later.done()  # it waits for the engine again
        steps.go_idle()
        assert later.result(WAIT_S) == "later"
    finally:
        steps.go_idle()
        pool.shutdown(wait=True)


def test_a_next_turn_runs_before_the_last_turns_copy_and_the_pages_go_back_once_it_is_made(loaded, make_engine,
                                                                                            tmp_path):
    """A chat's next turn, sent as its reply ends, finds the turn's store waiting for an idle spell (its copy
    out of the pages too): the turn runs first, and the pages the store held go back once it is copied."""
    tok = loaded.tokenizer
    engine = make_engine(tiers=TierConfig(host_bytes=0, disk_bytes=256 << 20, disk_path=tmp_path, chunk_pages=4,
                                          store_defer_ms=int(FOREVER_S * 1e3)))
    writer = engine.tiers.disk_tier.writer
    reply = SamplingParams(max_tokens=4, temperature=0.0)
    first = [{"role": "user", "content": "Notes on paging, step by step. " * 12}]

    async def main() -> None:
        a = AsyncEngine(engine)
        await a.start()
        try:
            held_open = a.generate(tok.encode_chat([{"role": "user", "content": "Keep going."}]),
                                   SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True))
            await held_open.__anext__()  # a request that keeps the engine busy while the turns run
            text = [o.text async for o in a.generate(tok.encode_chat(first), reply, session_id="s")]
            following = first + [{"role": "assistant", "content": "".join(text)}, {"role": "user", "content": "And?"}]
            async for _ in a.generate(tok.encode_chat(following), reply, session_id="s"):
                pass
            assert BACKGROUND_WORK.num_deferred == 2 and writer.num_written == 0  # the first turn's copy waits
            assert engine.kv.stores.num_copying >= 1  # ... holding its pages
            await held_open.aclose()  # idle: the copies are made, the writes land, the pages go back
            assert await asyncio.to_thread(until, lambda: writer.num_written >= 1 and not engine.kv.stores.num_copying)
        finally:
            await a.stop()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_a_running_request_holds_a_turns_disk_write_back_until_it_ends_or_the_engine_stops(loaded, make_engine,
                                                                                          tmp_path):
    tok = loaded.tokenizer
    engine = make_engine(tiers=TierConfig(host_bytes=0, disk_bytes=256 << 20, disk_path=tmp_path, chunk_pages=4,
                                          store_defer_ms=int(FOREVER_S * 1e3)))
    writer = engine.tiers.disk_tier.writer
    endless = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    turn = SamplingParams(max_tokens=2, temperature=0.0)

    def prompt(topic: str) -> list[int]:
        return tok.encode_chat([{"role": "user", "content": f"Notes on {topic}, step by step. " * 12}])

    async def turn_beside_a_long_request(a: AsyncEngine, session: str) -> object:
        """A session's turn that ends while another request decodes; returns that request's stream."""
        long = a.generate(prompt("decoding"), endless)
        await long.__anext__()  # it runs
        async for _ in a.generate(prompt(session), turn, session_id=session):
            pass
        # Its copy out of the pages and its write both wait, and neither takes a core from the steps.
        assert await asyncio.to_thread(until, lambda: BACKGROUND_WORK.num_deferred == 2)
        assert await asyncio.to_thread(until, lambda: not BACKGROUND_WORK.busy)
        return long

    async def main() -> None:
        a = AsyncEngine(engine)
        await a.start()
        try:
            long = await turn_beside_a_long_request(a, "first")
            assert writer.num_written == 0
            await long.aclose()  # the request ends: the engine goes idle
            await asyncio.to_thread(writer.wait)
            written = writer.num_written
            assert written >= 1 and BACKGROUND_WORK.num_deferred == 0

            long = await turn_beside_a_long_request(a, "second")
            assert writer.num_written == written
        finally:
            await a.stop()  # a stopped engine is idle: what waits lands
        await asyncio.to_thread(writer.wait)
        assert writer.num_written > written and BACKGROUND_WORK.num_deferred == 0
        await long.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.close()
