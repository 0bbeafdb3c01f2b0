"""The lower tiers on the real model: KV evicted from a tiny device pool comes back from the host or the
disk tier, and a session continues on a new engine over the same disk store. Every reply and its
logprobs equal the same prompt computed from scratch."""

from __future__ import annotations

import threading
from functools import partial

import engine_runs
import pytest
from engine_runs import assert_same_output, tokens

from kvtierd.cache.block_hash import hash_full_blocks
from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.config import TierConfig

# Replies of 8 tokens: the chain lengths the assertions below count on.
run_one = partial(engine_runs.run_one, params=SamplingParams(max_tokens=8, temperature=0.0, logprobs=True,
                                                             top_logprobs=2))

KV_TOKENS = 320  # 20 pages: two other prompts of ~150 tokens push the first one out
TOPICS = ("the block pool and its pages", "the scheduler and its token budget", "the disk store and its LRU")


def ask(tok, topic: str) -> list[int]:
    text = f"Here are some notes on {topic}. " + f"They describe {topic} in detail, step by step. " * 9
    return tok.encode_chat([{"role": "user", "content": text + "Summarise them."}])


@pytest.fixture
def cold(make_engine):
    engine = make_engine(enable_prefix_caching=False)
    return lambda prompt: run_one(engine, prompt)


def tiered(make_engine, host: bool = True, disk=None, **kw):
    config = TierConfig(host_bytes=(64 << 20) if host else 0, disk_bytes=(256 << 20) if disk else 0, disk_path=disk,
                        chunk_pages=4, **kw)
    return make_engine(kv_tokens=KV_TOKENS, tiers=config)


def push_out(engine, tok, first: list[int]) -> None:
    """Runs the first prompt, then two others that need its pages."""
    run_one(engine, first)
    for topic in TOPICS[1:]:
        run_one(engine, ask(tok, topic))
    pages = hash_full_blocks(engine._root(""), first, 16, algorithm=engine.kv.hash_algorithm)
    assert engine.kv.pool.block_of(pages[-1]) is None  # its own pages left the device (a shared head may stay)


def test_pages_evicted_to_the_host_tier_come_back_and_change_nothing(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = tiered(make_engine)
    prompt = ask(tok, TOPICS[0])
    assert 120 < len(prompt) < 200
    push_out(engine, tok, prompt)
    warm = run_one(engine, prompt)
    by_tier = warm[0].cached_tokens_by_tier
    assert by_tier["host"] >= 64 and by_tier["disk"] == 0
    assert warm[0].num_cached_tokens == sum(by_tier.values()) == (len(prompt) - 1) // 16 * 16
    assert_same_output(warm, cold(prompt))
    host = engine.tier_stats()[0]
    assert host.hits >= 2 and host.hit_tokens == by_tier["host"]


def test_a_prompt_of_whole_pages_comes_back_from_the_host_tier_to_its_last_token(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = tiered(make_engine)
    prompt = ask(tok, TOPICS[0])
    prompt = prompt[: len(prompt) // 16 * 16]  # its last page full: stored below with the others
    push_out(engine, tok, prompt)
    warm = run_one(engine, prompt)
    by_tier = warm[0].cached_tokens_by_tier
    assert by_tier["host"] >= 64
    assert warm[0].num_cached_tokens == sum(by_tier.values()) == len(prompt) - 1  # one token computed
    assert_same_output(warm, cold(prompt))


def test_pages_evicted_to_the_disk_tier_come_back_and_change_nothing(loaded, make_engine, cold, tmp_path):
    tok = loaded.tokenizer
    engine = tiered(make_engine, host=False, disk=tmp_path, disk_admission="all")
    prompt = ask(tok, TOPICS[0])
    push_out(engine, tok, prompt)
    engine.tiers.wait()  # the writes are asynchronous; a chunk not yet committed would be recomputed
    warm = run_one(engine, prompt)
    assert warm[0].cached_tokens_by_tier["disk"] >= 64
    assert_same_output(warm, cold(prompt))
    engine.close()


def test_a_session_continues_on_a_new_engine_from_the_disk_tier(loaded, make_engine, cold, tmp_path):
    tok = loaded.tokenizer
    messages = [{"role": "system", "content": "You are a terse assistant for a KV-cache daemon. " * 4},
                {"role": "user", "content": "What is a KV page?"}]
    first = make_engine(tiers=TierConfig(host_bytes=64 << 20, disk_bytes=256 << 20, disk_path=tmp_path))
    for question in ("And a page table?", "Why copy on write?"):
        reply = tok.decode(tokens(run_one(first, tok.encode_chat(messages), session_id="s")))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    first.close()  # what the turns wrote through is committed (no flush: as after kill -9 once written)
    second = make_engine(tiers=TierConfig(host_bytes=64 << 20, disk_bytes=256 << 20, disk_path=tmp_path))
    prompt = tok.encode_chat(messages)
    warm = run_one(second, prompt, session_id="s")
    assert warm[0].cache_source == "prefix" and warm[0].cached_tokens_by_tier["disk"] == warm[0].num_cached_tokens
    assert warm[0].num_cached_tokens >= len(prompt) - 32  # the new question and at most a page before it
    assert_same_output(warm, cold(prompt))
    second.close()


def test_an_invalidation_reaches_the_lower_tiers(loaded, make_engine):
    tok = loaded.tokenizer
    engine = tiered(make_engine)
    prompt = ask(tok, TOPICS[0])
    push_out(engine, tok, prompt)
    engine.invalidate_tenant("")
    assert run_one(engine, prompt)[0].num_cached_tokens == 0


def test_a_prefetch_waiting_or_finding_nothing_leaves_the_step_every_thread(loaded, make_engine, tmp_path):
    """A new prompt's prefetch looks the tiers below up and, usually, finds nothing: it must not take a core
    from the prompt's own first step (which started while the lookup ran, it did, for the whole prefill)."""
    tok = loaded.tokenizer
    engine = tiered(make_engine, disk=tmp_path)
    gate = threading.Event()
    engine.tiers._prefetcher._pool.submit(gate.wait)  # the prefetch thread is busy: the request's prefetch waits
    try:
        rid = engine.add_request(ask(tok, TOPICS[0]), run_one.keywords["params"])
        assert not BACKGROUND_WORK.busy
        # Its admission's own lookup may still be running at the first step (then that step waits for it, and
        # computes nothing): the prompt's first computed step is the one checked.
        for _ in range(1000):
            engine.step()
            if engine.last_step is not None:
                break
        assert engine.last_step.threads == engine.step_threads.num_threads
    finally:
        gate.set()
    engine.tiers.wait()
    assert not BACKGROUND_WORK.busy and engine.tier_stats()[1].prefetched == 0
    engine.abort_request(rid)
    engine.close()


def test_a_request_prefetches_its_chunks_from_disk_to_the_host_tier(loaded, make_engine, cold, tmp_path):
    tok = loaded.tokenizer
    prompt = ask(tok, TOPICS[0])
    first = tiered(make_engine, host=False, disk=tmp_path, disk_admission="all")
    push_out(first, tok, prompt)
    first.close()  # commits the disk writes; the next engine starts with an empty host tier
    engine = tiered(make_engine, disk=tmp_path)
    rid = engine.add_request(prompt, run_one.keywords["params"])
    engine.tiers.wait()  # the prefetch ran before the first step
    host, disk = engine.tier_stats()[:2]
    assert disk.prefetched >= 2 and host.entries == disk.prefetched and host.hits == 0
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    # Served from the host copy, counted for the disk tier that had it.
    assert outputs[0].cached_tokens_by_tier["disk"] >= 64 and outputs[0].cached_tokens_by_tier["host"] == 0
    assert outputs[0].restore.decision == "load"
    host, disk = engine.tier_stats()[:2]
    assert host.hits == 0 and disk.hits == disk.prefetched and engine.tiers.planner.rates()[0].keys() == {"host"}
    assert_same_output(outputs, cold(prompt))
    engine.close()


def test_recomputing_is_chosen_when_it_is_cheaper_than_loading(loaded, make_engine, cold):
    tok = loaded.tokenizer
    engine = tiered(make_engine)
    prompt = ask(tok, TOPICS[0])
    push_out(engine, tok, prompt)
    loaded_back = run_one(engine, prompt)  # loading is measured once it happens
    assert loaded_back[0].restore.decision == "load" and loaded_back[0].cached_tokens_by_tier["host"] >= 64
    push_out(engine, tok, prompt)
    planner = engine.tiers.planner
    assert planner.rates()[0]["host"] > 0 and planner.rates()[1] > 0
    planner.recompute_cost = lambda tokens: tokens * 1e-12  # as if prefill were nearly free (a fast GPU)
    warm = run_one(engine, prompt, looked_up=True)  # (a lookup's own deadline would pass before it answers)
    assert warm[0].restore.decision == "recompute" and warm[0].restore.num_found >= 2
    assert warm[0].restore.recompute_s < warm[0].restore.load_s
    assert warm[0].cached_tokens_by_tier["host"] == 0
    assert planner.decisions["recompute"] == 1 and "partial" not in planner.decisions
    assert_same_output(warm, cold(prompt))


def test_a_session_pinned_to_the_disk_tier_pins_each_new_turn(loaded, make_engine, tmp_path):
    tok = loaded.tokenizer
    messages = [{"role": "system", "content": "You are a terse assistant for a KV-cache daemon. " * 4},
                {"role": "user", "content": "What is a KV page?"}]
    engine = make_engine(tiers=TierConfig(host_bytes=64 << 20, disk_bytes=256 << 20, disk_path=tmp_path,
                                          chunk_pages=4))
    reply = tok.decode(tokens(run_one(engine, tok.encode_chat(messages), session_id="s")))
    pin = engine.pin_session("pin-s", "s", tier="disk")
    held = engine.tiers.pins["pin-s"]
    assert pin.tier == "disk" and pin.block_ids == [] and engine.kv.pool.num_pinned_blocks == 0
    assert len(held.keys) >= 2 and engine.tiers.disk.contains_prefix(list(held.keys)) == len(held.keys)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a page table?"}]
    run_one(engine, tok.encode_chat(messages), session_id="s")
    followed = engine.tiers.pins["pin-s"]
    # The chain grew: its whole chunks stay pinned, its partial last chunk is now a longer one.
    assert followed.nbytes > held.nbytes and followed.keys[: len(held.keys) - 1] == held.keys[:-1]
    assert followed.keys[-1] != held.keys[-1]
    assert engine.tiers.disk.contains_prefix(list(followed.keys)) == len(followed.keys)
    assert engine.unpin("pin-s") is not None and "pin-s" not in engine.tiers.pins
    engine.close()


def test_idle_work_saves_the_chunks_next_in_line_so_their_eviction_copies_nothing(loaded, make_engine, cold):
    tok = loaded.tokenizer
    prompt = ask(tok, TOPICS[0])
    twin, engine = tiered(make_engine), tiered(make_engine)
    for e in (twin, engine):
        run_one(e, prompt)
    while engine.on_idle():  # the free-page watermark: the idle pages' chunks go to the host tier now
        pass
    hashes = hash_full_blocks(engine._root(""), prompt, 16, algorithm=engine.kv.hash_algorithm)
    found = engine.tiers.lookup(engine._root(""), hashes, prompt, 0)
    assert len(found) >= 2 and {f.tier for f in found} == {"host"}  # while its pages are still on the device
    saved = engine.tier_stats()[0].writes
    for e in (twin, engine):
        push_out(e, tok, prompt)
    # The same chunks went to the host tier in both: the watermark's earlier, and never twice.
    assert engine.tier_stats()[0].writes == twin.tier_stats()[0].writes >= saved
    warm = run_one(engine, prompt)
    assert warm[0].cached_tokens_by_tier["host"] >= 64
    assert_same_output(warm, cold(prompt))
