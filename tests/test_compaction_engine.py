"""Compaction on the real model: pages moved between steps, while requests run, change no output, and
what was cached still hits. Each run is compared with the same workload on an engine that never compacts."""

from __future__ import annotations

import asyncio

from engine_runs import PARAMS, assert_same_output, run_one, tokens

from kvtierd.engine.async_engine import AsyncEngine

SYSTEM = {"role": "system", "content": "You are a terse assistant for a KV-cache daemon. " * 3}
DOC = "Release notes, version 3: pages are now 4 tokens and compaction moves them together. " * 2


def ask(text: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": text}]


def doc(text: str) -> list[dict]:
    return [{"role": "user", "content": DOC + text}]


def workload(engine, compact: bool):
    """A session's first turn, two documents (one then invalidated: a hole in the middle of the pages),
    then three requests and the session's next turn at once, compacted twice while they run, and a third
    turn. Returns each request's outputs, in order, and the compactions' results."""
    tok = engine.loaded.tokenizer
    messages = ask("What is a KV page?")
    outputs = [run_one(engine, tok.encode_chat(messages), session_id="s")]
    summarise = tok.encode_chat(doc("Summarise."))
    outputs.append(run_one(engine, summarise))
    outputs.append(run_one(engine, tok.encode_chat(ask("Name three caches."))))
    assert engine.invalidate_prefix(summarise) > 0  # its own pages; the first, shared with the others, stays
    messages += [{"role": "assistant", "content": tok.decode(tokens(outputs[0]))},
                 {"role": "user", "content": "And a page table?"}]
    ids = [engine.add_request(tok.encode_chat(m), PARAMS)
           for m in (ask("What is paging?"), ask("Name three caches, briefly."), doc("What changed?"))]
    ids.append(engine.add_request(tok.encode_chat(messages), PARAMS, session_id="s"))
    by_id: dict[str, list] = {i: [] for i in ids}
    results, steps = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            by_id[out.request_id].append(out)
        steps += 1
        if compact and steps in (2, 6):  # mid-prefill (64-token chunks), then mid-decode
            results.append(engine.compact())
    outputs += [by_id[i] for i in ids]
    messages += [{"role": "assistant", "content": tok.decode(tokens(by_id[ids[-1]]))},
                 {"role": "user", "content": "Thanks."}]
    if compact:
        results.append(engine.compact())  # idle now
    outputs.append(run_one(engine, tok.encode_chat(messages), session_id="s"))
    return outputs, results


def test_compacting_between_steps_changes_no_output_and_keeps_every_hit(make_engine):
    config = dict(block_size=4, kv_tokens=1024, max_num_batched_tokens=64)
    plain, _ = workload(make_engine(**config), compact=False)
    engine = make_engine(**config)
    compacted, results = workload(engine, compact=True)
    assert len(compacted) == len(plain)
    for warm, cold in zip(compacted, plain):
        assert_same_output(warm, cold)
        assert (warm[0].num_cached_tokens, warm[0].cache_source) == (cold[0].num_cached_tokens, cold[0].cache_source)
    assert compacted[-1][0].cache_source == compacted[-2][0].cache_source == "session"
    mid = results[0]
    assert mid.pages_moved > 0 and mid.before.sequence > 0
    assert all(r.after.free_space == r.after.sequence == 0 for r in results)
    assert engine.counters.compactions == 3
    assert engine.counters.compacted_pages == sum(r.pages_moved for r in results)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks  # every page came back


def test_the_async_engine_compacts_when_it_goes_idle(loaded, make_engine):
    tok = loaded.tokenizer
    prompts = [tok.encode_chat(m) for m in (doc("Summarise."), ask("What is paging?"), ask("Name three caches."))]
    plain = make_engine(block_size=4)
    expected = [tokens(run_one(plain, p)) for p in prompts]
    engine = make_engine(block_size=4, compact_threshold=0.01)

    async def main():
        front = AsyncEngine(engine)
        await front.start()
        try:
            async def generate(prompt, **request):
                return [t async for out in front.generate(prompt, PARAMS, **request) for t in out.token_ids]

            outputs = [await generate(prompts[0])]
            compactions = await front.call(lambda: engine.invalidate_prefix(prompts[0]) and engine.counters.compactions)
            # Two at once, in the hole the document left and above it: their pages interleave.
            outputs += await asyncio.gather(*(generate(p) for p in prompts[1:]))
            for _ in range(500):  # once idle, the engine compacts on the step thread
                if engine.counters.compactions > compactions:
                    break
                await asyncio.sleep(0.01)
            return outputs, await front.call(engine.kv.fragmentation)
        finally:
            await front.stop()

    outputs, fragmentation = asyncio.run(main())
    assert outputs == expected
    assert engine.counters.compactions >= 1 and fragmentation.free_space == fragmentation.sequence == 0
